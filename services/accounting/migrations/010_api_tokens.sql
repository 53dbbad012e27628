-- HTTP API tokens (ApiTokenIssued / ApiTokenRevoked): the SHA-256 of each token's secret, never
-- the secret. The API reads this table to authenticate a request.
CREATE TABLE api_tokens (
    token_id    text PRIMARY KEY,
    name        text NOT NULL,
    role        text NOT NULL,                 -- member, operator, chargeback, admin
    team        text,                          -- a member token's team
    token_hash  text NOT NULL,
    issued_by   text NOT NULL,
    issued_at   timestamptz NOT NULL,
    expires_at  timestamptz,
    revoked_at  timestamptz,
    revoked_by  text,
    sequence    bigint NOT NULL
);
