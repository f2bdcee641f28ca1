"""RabbitMQ: every name hookline uses and the declarations that create them (:mod:`.topology`), the
session each service holds (:mod:`.amqp`), streams and the local views derived from them, records held
through an alarm, where an endpoint is delivered from (a shared lane or a queue of its own) and giving
it that queue, and administration: the broker's resources and the users' rights."""
