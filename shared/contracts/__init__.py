"""What crosses a boundary between hookline's processes, its publishers and its customers' endpoints:
events and endpoints as typed models, an event as an AMQP message and the headers hookline adds, the
request an endpoint receives, the records dispatchers send the monitor (attempt telemetry, breaker
commands, status bodies), dead-letter records, identifiers and the address of a copy sent to one
endpoint. Pure data and its rules; no I/O."""
