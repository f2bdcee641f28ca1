"""Code common to hookline's services, by concept: ``contracts`` (what crosses a boundary), ``broker``
(RabbitMQ names, sessions, streams, placement), ``state`` (what every replica derives from the change
log), ``outbound`` (calling a customer's URL) and ``runtime`` (a process: settings, logs, loops, APIs).
What one service alone uses lives in that service."""

__version__ = "0.1.0"
