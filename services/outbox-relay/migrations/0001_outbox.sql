-- hookline's transactional outbox, version 1 (PostgreSQL 13 or newer).
--
-- An upstream writes one row here in the same transaction as its business change; `hookline
-- outbox-relay` publishes committed rows to the `events` exchange and marks them sent once RabbitMQ has
-- confirmed them. Apply with `hookline outbox-relay --dsn ... --migrate`, or with psql: every statement
-- is idempotent, so applying it again changes nothing.

CREATE TABLE IF NOT EXISTS hookline_outbox (
    -- Creation order: the relay publishes in this order (within a subject: by sequence, when numbered).
    position        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The event's id, which receivers get as webhook-id: give your own to make a retried business
    -- transaction idempotent, or let the default make one.
    id              text NOT NULL DEFAULT ('evt_' || replace(gen_random_uuid()::text, '-', '')),
    tenant          text NOT NULL,
    type            text NOT NULL,
    subject         text,
    -- The event's place among its subject's events (webhook-sequence): give it, or set numbered.
    sequence        bigint,
    -- true: the sequence is the next of the (tenant, subject) counter, taken in this transaction.
    numbered        boolean NOT NULL DEFAULT false,
    schema_version  integer NOT NULL DEFAULT 1,
    data            jsonb NOT NULL,
    occurred_at     timestamptz NOT NULL DEFAULT now(),
    -- The W3C trace context of the business transaction, followed to every delivery attempt.
    traceparent     text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at         timestamptz,
    -- Set by the relay on a row it cannot publish (the reason); such a row stays, unsent, until
    -- someone fixes it and sets error back to NULL.
    error           text,
    CONSTRAINT hookline_outbox_id_unique UNIQUE (id),
    CONSTRAINT hookline_outbox_id_format CHECK (id ~ '^[A-Za-z0-9_.:-]{1,128}$'),
    CONSTRAINT hookline_outbox_tenant_format CHECK (tenant ~ '^[a-z0-9_-]{1,64}$'),
    CONSTRAINT hookline_outbox_type_format
        CHECK (type ~ '^[a-z0-9_]+(\.[a-z0-9_]+)*$' AND length(type) <= 190),
    CONSTRAINT hookline_outbox_subject_length CHECK (length(subject) BETWEEN 1 AND 256),
    CONSTRAINT hookline_outbox_sequence_needs_subject
        CHECK ((sequence IS NULL AND NOT numbered) OR subject IS NOT NULL),
    CONSTRAINT hookline_outbox_sequence_range CHECK (sequence >= 0),
    CONSTRAINT hookline_outbox_schema_version CHECK (schema_version >= 1),
    CONSTRAINT hookline_outbox_data_object CHECK (jsonb_typeof(data) = 'object')
);

-- What the relay claims, oldest first; small however many sent rows the retention keeps.
CREATE INDEX IF NOT EXISTS hookline_outbox_pending
    ON hookline_outbox (position) WHERE sent_at IS NULL AND error IS NULL;
-- The earlier unsent rows of a subject, which hold its later rows back.
CREATE INDEX IF NOT EXISTS hookline_outbox_pending_subject
    ON hookline_outbox (tenant, subject, position) WHERE sent_at IS NULL AND error IS NULL;
-- Sent rows past their retention, deleted by the relay.
CREATE INDEX IF NOT EXISTS hookline_outbox_sent
    ON hookline_outbox (sent_at) WHERE sent_at IS NOT NULL;

-- The last sequence given to each subject. Numbering a row locks its subject's counter until the
-- transaction ends, so a subject's numbered rows commit in sequence order, without gaps.
CREATE TABLE IF NOT EXISTS hookline_outbox_sequences (
    tenant          text NOT NULL,
    subject         text NOT NULL,
    last_sequence   bigint NOT NULL,
    PRIMARY KEY (tenant, subject)
);

CREATE OR REPLACE FUNCTION hookline_outbox_number() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.numbered AND NEW.sequence IS NULL AND NEW.subject IS NOT NULL THEN
        INSERT INTO hookline_outbox_sequences AS counter (tenant, subject, last_sequence)
        VALUES (NEW.tenant, NEW.subject, 1)
        ON CONFLICT (tenant, subject) DO UPDATE SET last_sequence = counter.last_sequence + 1
        RETURNING last_sequence INTO NEW.sequence;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS hookline_outbox_number ON hookline_outbox;
CREATE TRIGGER hookline_outbox_number
    BEFORE INSERT ON hookline_outbox
    FOR EACH ROW EXECUTE FUNCTION hookline_outbox_number();

-- Wakes the relays when the inserting transaction commits (once per statement: a NOTIFY is not free).
CREATE OR REPLACE FUNCTION hookline_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('hookline_outbox', '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS hookline_outbox_notify ON hookline_outbox;
CREATE TRIGGER hookline_outbox_notify
    AFTER INSERT ON hookline_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION hookline_outbox_notify();
