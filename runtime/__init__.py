"""The shared runtime every service stands on: the event-log client (`eventlog`), the decision
loop (`loop`), settings (`settings`), the platform clock (`clock`) and observability
(`observability`). It imports `schemas/` and nothing of `services/` or the applications."""
