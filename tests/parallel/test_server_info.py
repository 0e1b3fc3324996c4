"""GetServerInfo carries the mesh stats() reports (ServerInfo.mesh), and a one-device engine's
stats describe a 1 x 1 mesh."""

from jaxserve.engine.stats import EngineStats
from jaxserve.server.convert import server_info


def stats(**mesh) -> EngineStats:
    return EngineStats(num_kv_blocks_total=10, num_kv_blocks_free=10, num_kv_blocks_cached=0, num_requests_running=0,
                       num_requests_waiting=0, num_preemptions=0, num_compilations_after_warmup=0,
                       prompt_tokens_total=0, generation_tokens_total=0, prefix_cache_queries=0, prefix_cache_hits=0,
                       num_requests_finished=0, uptime_s=1.0, **mesh)


def test_server_info_reports_the_mesh():
    info = server_info(stats(mesh_num_devices=4, mesh_num_hosts=2, mesh_axis_sizes=(("data", 1), ("model", 4))),
                       active_streams=0, state="serving")
    assert (info.mesh.num_devices, info.mesh.num_hosts) == (4, 2)
    assert dict(info.mesh.axis_sizes) == {"data": 1, "model": 4}


def test_one_device_is_a_one_by_one_mesh():
    s = stats()
    assert (s.mesh_num_devices, s.mesh_num_hosts) == (1, 1)
    assert s.as_dict()["mesh_axis_sizes"] == {"data": 1, "model": 1}
    assert dict(server_info(s, active_streams=0, state="serving").mesh.axis_sizes) == {"data": 1, "model": 1}
