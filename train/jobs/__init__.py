"""One module per training job; each defines NAME and Config (discovered by the manifest loader)."""
