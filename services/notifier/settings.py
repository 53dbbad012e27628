"""The notifier's own settings (docs/notifications.md), read from the environment."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.settings import ConfigError, env_networks, env_number, env_value
from runtime.teams import partition_from_env
from schemas.egress import Network


@dataclass(frozen=True)
class NotifierSettings:
    """The notifier's own settings (docs/notifications.md)."""

    max_attempts: int = 6
    timeout_s: float = 5.0
    backoff_cap_s: float = 30.0
    secrets: dict[str, str] = field(default_factory=dict)  # team -> webhook signing secret
    partitions: int = 1  # notifiers sharing the teams (GPUSCHED_NOTIFIER_PARTITIONS)
    partition: int = 0  # this one's share (GPUSCHED_NOTIFIER_PARTITION): the teams partition_of maps here
    # networks webhooks may reach beside public addresses (GPUSCHED_WEBHOOK_ALLOW; services.notifier.egress)
    webhook_allow: tuple[Network, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.partition < self.partitions:
            raise ConfigError(f"GPUSCHED_NOTIFIER_PARTITION={self.partition} is out of range; accepted: 0.."
                              f"{self.partitions - 1} (GPUSCHED_NOTIFIER_PARTITIONS={self.partitions})")

    @classmethod
    def from_env(cls) -> "NotifierSettings":
        partitions, partition = partition_from_env("GPUSCHED_NOTIFIER_PARTITIONS", "GPUSCHED_NOTIFIER_PARTITION")
        return cls(
            max_attempts=int(env_number("GPUSCHED_WEBHOOK_MAX_ATTEMPTS", 6, minimum=1, maximum=20, integer=True)),
            timeout_s=env_number("GPUSCHED_WEBHOOK_TIMEOUT_S", 5.0, minimum=0.1, maximum=60),
            backoff_cap_s=env_number("GPUSCHED_WEBHOOK_BACKOFF_CAP_S", 30.0, minimum=0.1, maximum=3600),
            secrets=_read_secrets(env_value("GPUSCHED_WEBHOOK_SECRETS_FILE")),
            partitions=partitions, partition=partition,
            webhook_allow=env_networks("GPUSCHED_WEBHOOK_ALLOW"),
        )


def _read_secrets(path: str | None) -> dict[str, str]:
    """Team -> signing secret, from a JSON object file; no file: no team gets webhooks."""
    if path is None:
        return {}
    try:
        secrets = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"GPUSCHED_WEBHOOK_SECRETS_FILE={path!r} cannot be read ({err}); accepted: a JSON "
                          "object of team name to secret") from None
    if not isinstance(secrets, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) >= 16
                                                for k, v in secrets.items()):
        raise ConfigError(f"GPUSCHED_WEBHOOK_SECRETS_FILE={path!r}: accepted: a JSON object of team name to a secret "
                          "of at least 16 characters")
    return secrets
