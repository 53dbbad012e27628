"""The bulk-load wing behind the ingest pipeline: what makes a large batch or a whole rebuild
fast without changing what it writes.

* :mod:`.copy`: a large group of rows goes by COPY (new rows straight into their table, changes
  through a temporary staging table and one set-based statement);
* :mod:`.indexes`: a fresh shadow loads with its secondary indexes deferred, built at the end;
* :mod:`.writers`: writer processes that each read, convert and write their own ranges of the
  log, committing in log order;
* :mod:`.collector`: the garbage collector run per batch while a replay allocates.
"""
