"""`import monitor` needs neither torch nor mindspore, and picks no adapter until set_monitor."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_monitor_without_torch_installed():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None        # makes "import torch" fail as if it were not installed
        sys.modules["mindspore"] = None
        import monitor
        from monitor import TrainerMon, ConfigError, load_config
        mon = TrainerMon({"wg_distribution": True})
        assert mon.config.wg_distribution
        try:
            mon.set_monitor(object(), 1, object())
        except TypeError as exc:
            assert "torch.nn.Module" in str(exc)
        print("ok", monitor.__version__)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")


def test_importing_monitor_does_not_import_a_framework():
    script = "import sys, monitor; print(sorted(m for m in ('torch', 'mindspore') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
