"""Which process is which host: the flags, else JAX's environment variables, and clear errors
(jaxserve/parallel/distributed.py). Pure; joins nothing."""

import pytest

from jaxserve.parallel.distributed import HostConfig

JAX_ENV = ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS")


@pytest.fixture(autouse=True)
def no_jax_env(monkeypatch):
    for name in JAX_ENV:
        monkeypatch.delenv(name, raising=False)


def test_one_host_needs_no_coordinator():
    assert HostConfig.resolve(1, None, None, 30.0) is None


def test_flags_name_the_host():
    c = HostConfig.resolve(2, 1, "10.0.0.1:1234", 30.0)
    assert (c.num_hosts, c.host_rank, c.coordinator_address, c.is_leader) == (2, 1, "10.0.0.1:1234", False)


def test_jax_environment_variables_stand_in_for_the_flags(monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:9000")
    c = HostConfig.resolve(1, None, None, 30.0)
    assert (c.num_hosts, c.host_rank, c.coordinator_address, c.is_leader) == (4, 0, "host0:9000", True)


def test_missing_or_wrong_rank_and_address_are_refused():
    with pytest.raises(ValueError, match="needs host_rank and coordinator_address"):
        HostConfig.resolve(2, None, "h:1", 30.0)
    with pytest.raises(ValueError, match="needs host_rank and coordinator_address"):
        HostConfig.resolve(2, 0, None, 30.0)
    with pytest.raises(ValueError, match=r"host_rank=2 must be in \[0, 2\)"):
        HostConfig.resolve(2, 2, "h:1", 30.0)
