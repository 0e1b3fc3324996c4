"""Running a check on N fake CPU devices: in a child process, since the device count is fixed
when jax's backend starts.

The suite runs in one pytest process whose jax may already be up with one device (earlier tests
start it), so a device count set in tests/conftest.py would have to hold for every test of the
suite; giving the whole suite 8 devices would change what every other test runs on (and each
executable's cache key) for the sake of these few. A child per check costs its jax import
(2-3 s), which is why each child runs a whole group of checks and reports them as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_probe.py")


def cpu_device_env(num_devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}"])
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def run_probe(num_devices: int, *args: str, timeout: float = 850) -> dict:
    """Run tests/parallel/tp_probe.py with `args` on `num_devices` CPU devices; its JSON report."""
    proc = subprocess.run([sys.executable, PROBE, *args], env=cpu_device_env(num_devices), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"probe {args} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
