"""The outbox relay: publishes the rows of an upstream's outbox table (one INSERT in the business
transaction) to ``events`` with publisher confirms, marking each sent only once RabbitMQ has it."""
