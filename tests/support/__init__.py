"""Real parts for tests: a RabbitMQ vhost per test, an HTTP receiver on 127.0.0.1, service processes."""
