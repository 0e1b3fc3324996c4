import subprocess
import sys


def test_importing_sched_does_not_import_jax():
    code = (
        "import sys, jaxserve.sched, jaxserve.sched.scheduler, jaxserve.sched.prefix_cache; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
