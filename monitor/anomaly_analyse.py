"""``python -m monitor.anomaly_analyse``: rank recorded anomalies (see monitor.anomaly.analyse)."""

from monitor.anomaly.analyse import main

if __name__ == "__main__":
    raise SystemExit(main())
