"""kvguard's findings in the requests' own traces (OpenTelemetry).

At admission kvguard reads a request's W3C trace context (vLLM's ``Request.trace_headers``,
kept by vLLM when the server runs with ``--otlp-traces-endpoint``); each leak finding,
transfer outcome and transfer hazard about that request becomes a span in its trace
(:mod:`kvguard.tracing.records` names them). The engine thread only queues plain records
(:mod:`kvguard.tracing.queue`); one daemon thread builds and exports the spans over OTLP
(:mod:`kvguard.tracing.otlp`, the ``kvguard[otel]`` extra, imported only when an endpoint is
configured: :mod:`kvguard.tracing.config`). The public names are in ``kvguard.__all__``.
"""
