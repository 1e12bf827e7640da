"""Batch scoring (scoremap-score): folders into a resumable results.jsonl, maps and heatmaps, on a server,
in this process (--local) or on Ray actors; and the demo that runs it end to end."""
