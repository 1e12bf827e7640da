"""Load testing (scoremap-loadtest): closed and open loops against one server, latency reports, and the
server's own per-stage split read from its metrics."""
