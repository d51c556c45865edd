"""The sidecar: reads engine state files, keeps history, serves HTTP and Prometheus metrics."""
