"""gpusched/permissions.py: the shape of each credential's permissions (the real server checks
them in tests/integration/test_permission_matrix.py)."""

from __future__ import annotations

import pytest

from gpusched import permissions


def test_a_users_credential_has_its_own_inbox_apart_from_its_team_and_other_teams():
    inboxes = {who: permissions.permissions(who)["subscribe"]["allow"][0]
               for who in ("team-a", "team-a.alice", "team-b.alice")}
    assert inboxes == {"team-a": "_INBOX.team-a.>", "team-a.alice": "_INBOX.team-a_alice.>",
                       "team-b.alice": "_INBOX.team-b_alice.>"}
    alice = permissions.permissions("team-a.alice")["publish"]["allow"]
    assert "gpusched.intake.team-a.user.alice.submit" in alice
    assert not any(s.startswith("gpusched.intake.team-a.submit") for s in alice)


@pytest.mark.parametrize("name", ["admin", "operator", "quota", "notifier"])
def test_a_team_may_not_take_a_platform_credentials_name(name):
    with pytest.raises(ValueError, match="is not a team name"):
        permissions.tenant_permissions(name)


def test_no_credential_but_the_admin_may_subscribe_to_every_inbox():
    for who in ("operator", *permissions.SERVICES, "team-a", "team-a.bob"):
        perms = permissions.permissions(who)
        assert "_INBOX.>" not in perms["subscribe"]["allow"], who
        assert not any(s in (">", "$JS.API.>") for s in perms["publish"]["allow"]), who
