"""Files the CLI reads (issue 21, finding 4): whatever a job, queues or price book file holds, the
command ends in well under a second with one line naming the file and the field, exit status 2,
and no traceback. No broker is needed: a file is checked whole before the CLI connects."""

from __future__ import annotations

import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gpusched import userinput
from gpusched.cli.main import app
from gpusched.userinput import MAX_DEPTH, MAX_FILE_BYTES, UserError, read_document

JOB = "kind: training\nqueue: research\nteam: team-a\nimage: img\ngpus: 1\n"
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))

# (file bytes, what the one error line says after the file name)
BAD_FILES = [
    (b"kind: training\nqueue: q\xff\n", "line 2: not UTF-8 (byte 0xff at offset 23); accepted: UTF-8 text"),
    (JOB.encode() + b"submitter: \xed\xa0\x80\n", "line 6: not UTF-8 (byte 0xed"),  # a surrogate, UTF-8 encoded
    (b"\xef\xbb\xbf" + JOB.encode(), "starts with a UTF-8 byte order mark; accepted: UTF-8 without one"),
    (b"\xff\xfek\x00", "not UTF-8"),  # UTF-16
    (JOB.encode() + b'submitter: "a\\ud800"\n',
     "line 6, column 16: not valid YAML: while parsing a quoted scalar found invalid Unicode character escape code"),
    (JOB.encode() + b'env: {A: "x\\0"}\n', "env.A: contains a NUL character at offset 1"),
    (b"[" * 5000 + b"]" * 5000, "nested more than 32 levels deep; accepted: at most 32 levels"),
    (b"[" * 40 + b"]" * 40, "line 1, column 33: nested more than 32 levels deep; accepted: at most 32 levels"),
    ("".join("  " * i + "a:\n" for i in range(40)).encode(), "nested more than 32 levels deep"),
    (LAUGHS.encode(), "more than 100000 values (aliases expanded); accepted: at most 100000"),
    (b"a: &a [1, *a]\n", "alias *a refers to a node that is not defined before it or contains it"),
    (b"a: *nope\n", "alias *nope refers to a node that is not defined"),
    (b"a: [1, 2\n", "not valid YAML: "),
    (b"a: !!python/object:os.system x\n", "not valid YAML: could not determine a constructor"),
    (b"--- 1\n--- 2\n", "not valid YAML: expected a single document in the stream but found another document"),
]


def write(tmp_path, data: bytes, name: str = "job.yaml"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("data, message", BAD_FILES)
def test_the_reader_names_the_file_and_what_is_accepted(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(UserError) as err:
        read_document(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_the_size_is_checked_before_reading_further(tmp_path):
    path = write(tmp_path, b"a: " + b"x" * MAX_FILE_BYTES)
    with pytest.raises(UserError, match="larger than 1048576 bytes; accepted: files of at most 1 MiB"):
        read_document(path)
    with pytest.raises(UserError, match="No such file or directory"):
        read_document(tmp_path / "absent.yaml")
    with pytest.raises(UserError, match="Is a directory"):
        read_document(tmp_path)


def test_aliases_within_the_limits_and_json_are_read(tmp_path):
    assert read_document(write(tmp_path, b"base: &b {gpus: 1}\njob: *b\n")) == {"base": {"gpus": 1}, "job": {"gpus": 1}}
    deepest = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert read_document(write(tmp_path, deepest)) is not None
    assert read_document(write(tmp_path, b'{"queues": [{"name": "q"}]}', "q.json")) == {"queues": [{"name": "q"}]}


def test_unpaired_surrogates_are_refused_by_field():
    """libyaml refuses a "\\ud800" escape itself; the check also covers YAML's pure-Python loader."""
    with pytest.raises(UserError, match=r"^f: spec.env.A: contains an unpaired UTF-16 surrogate at offset 1;"):
        userinput.check_text({"spec": {"env": {"A": "x\ud800"}}}, "f")
    with pytest.raises(UserError, match=r"^f: spec: contains a NUL character at offset 0;"):
        userinput.check_text({"spec": {"\x00": 1}}, "f")


def test_a_huge_value_in_an_error_is_cut():
    assert userinput.shorten("x" * 100_000) == "x" * 60 + "… (100000 characters)"
    assert userinput.one_line("a\nb  c") == "a b c"


def cli(*args: str, env: dict | None = None):
    runner = CliRunner()
    start = time.perf_counter()
    result = runner.invoke(app, list(args), env={"GPUSCHED_NATS_URL": "nats://127.0.0.1:1",
                                                 "GPUSCHED_CONNECTION_FILE": "/nonexistent", **(env or {})})
    return result, time.perf_counter() - start


@pytest.mark.parametrize("command", [["submit", "--no-wait"], ["apply"], ["prices"]])
@pytest.mark.parametrize("data, message", [BAD_FILES[0], BAD_FILES[4], BAD_FILES[6], BAD_FILES[9]])
def test_each_command_that_reads_a_file_exits_2_with_one_line(tmp_path, command, data, message):
    path = write(tmp_path, data)
    result, seconds = cli(*command, "-f", str(path))
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.stderr.strip().splitlines() == [f"error: {path}: " + result.stderr.split(f"{path}: ", 1)[1].strip()]
    assert message in result.stderr and "Traceback" not in result.output
    assert seconds < 1.0


@pytest.mark.parametrize("command, text, message", [
    (["apply"], "queues: [{name: " + "a" * 100_000 + "}]\n", "queues.0.name: String should have at most 63 characters"),
    (["apply"], "cohorts: [{name: " + "a" * 100_000 + "}]\nqueues: []\n", "cohorts.0.name: String should have at most 63"),
    (["apply"], "queues:\n- name: q\n  ? " + "k" * 100_000 + "\n  : 1\n", "queues.0." + "k" * 60 + "… (100000 characters)"),
    (["apply"], "price_books: [{name: " + "a" * 100_000 + ", effective_from: 2026-11-01T00:00:00Z}]\n",
     "price_books.0.name: String should have at most 63"),
    (["submit"], JOB.replace("research", "r" * 70_000), "(root): command is 70"),
    (["submit"], JOB.replace("research", "r" * 30_000), "spec.queue: String should"),
])
def test_a_100_kB_name_is_refused_at_once(tmp_path, command, text, message):
    """It took minutes: rich wrapped the one-word 100 kB error line in quadratic time."""
    result, seconds = cli(*command, "-f", str(write(tmp_path, text.encode())))
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr) < userinput.MAX_LINE + 100
    assert seconds < 1.0


def test_printing_a_long_error_is_fast(capsys):
    start = time.perf_counter()
    userinput.print_error(Console(stderr=True, width=80), "x" * 100_000)
    assert time.perf_counter() - start < 0.5
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "(root): expected a mapping with the job spec, got list"),
    (JOB.replace("gpus: 1", "gpus: -1"), "spec.gpus: Input should be greater than or equal to 0"),
    (JOB + "deadline: !!binary aGVsbG8=\n", "a bytes value (YAML tag such as !!binary or !!set) is not accepted"),
    (JOB + "args: !!set {a, b}\n", "a set value"),
    ("spec: {" + JOB.replace("\n", ", ").rstrip(", ") + "}\njob_id: rejected-1\n", "job_id: "),
])
def test_a_job_file_is_checked_as_admission_checks_a_command(tmp_path, text, message):
    result, _ = cli("submit", "--no-wait", "-f", str(write(tmp_path, text.encode())))
    assert result.exit_code == 2
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("data, message", [(b"\xff", "not UTF-8"), (b"[1]", "(root): expected a mapping"),
                                           (b"{nats_url: [", "not valid YAML")])
def test_a_broken_connection_file_is_one_line(tmp_path, data, message):
    result, _ = cli("jobs", env={"GPUSCHED_CONNECTION_FILE": str(write(tmp_path, data, "connection.json"))})
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1
