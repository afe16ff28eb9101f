"""Ready configs for the common jobs; `trainmon demo` uses everything_alerts.yaml."""
