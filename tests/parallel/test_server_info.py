"""GetServerInfo carries the mesh stats() reports (ServerInfo.mesh), and a one-device engine's
stats describe a 1 x 1 mesh."""

from jaxserve.engine.stats import EngineStats
from jaxserve.parallel.mesh import MeshInfo
from jaxserve.server.convert import server_info
from tests.engine.idle_stats import idle_scheduler_stats


def stats(**mesh) -> EngineStats:
    return EngineStats(idle_scheduler_stats(num_kv_blocks_total=10, num_kv_blocks_free=10), **mesh)


def test_server_info_reports_the_mesh():
    info = server_info(stats(mesh=MeshInfo(4, 2, (("data", 1), ("model", 4)), "cpu")),
                       active_streams=0, state="serving")
    assert (info.mesh.num_devices, info.mesh.num_hosts) == (4, 2)
    assert dict(info.mesh.axis_sizes) == {"data": 1, "model": 4}


def test_one_device_is_a_one_by_one_mesh():
    s = stats()
    assert (s.mesh.num_devices, s.mesh.num_hosts) == (1, 1)
    assert s.as_dict()["mesh"]["axis_sizes"] == {"data": 1, "model": 1}
    assert dict(server_info(s, active_streams=0, state="serving").mesh.axis_sizes) == {"data": 1, "model": 1}
