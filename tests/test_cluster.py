"""Ray's CPUs become torch threads: a task or actor computes on as many threads as whole CPUs it holds."""

import torch

from pipelines.cluster import use_assigned_cpus


def test_a_task_computes_on_as_many_threads_as_whole_cpus_it_holds(ray_cluster):
    @ray_cluster.remote
    def threads_in_a_reused_worker():
        import torch

        from pipelines.cluster import use_assigned_cpus

        torch.set_num_threads(1)  # what a pooled worker keeps after torch was first imported by a 1-CPU task
        return use_assigned_cpus(), torch.get_num_threads()

    assert ray_cluster.get(threads_in_a_reused_worker.options(num_cpus=2).remote()) == (2, 2)
    assert ray_cluster.get(threads_in_a_reused_worker.options(num_cpus=1).remote()) == (1, 1)
    assert ray_cluster.get(threads_in_a_reused_worker.options(num_cpus=0.25).remote()) == (1, 1)


def test_a_worker_that_looks_its_cluster_up_finds_its_own(ray_cluster):
    """Ray Train's placement-group cleaner asks the state API, without an address, whether its controller lives; the
    address comes from the cluster's address file. The session cluster's file is its own, not the machine-wide one
    that every cluster started later on the machine (the other test process's, another checkout's) overwrites: a
    cleaner told by a foreign cluster that its controller does not exist removes the run's placement group."""
    from ray._common.utils import get_default_ray_temp_dir

    @ray_cluster.remote(num_cpus=0)
    def lookup():
        from ray._common.utils import get_ray_address_file
        from ray._private.services import canonicalize_bootstrap_address_or_die

        return get_ray_address_file(None), canonicalize_bootstrap_address_or_die(None)

    address_file, address = ray_cluster.get(lookup.remote())
    assert address == ray_cluster.get_runtime_context().gcs_address
    assert not address_file.startswith(get_default_ray_temp_dir() + "/")  # this process's default: the machine's


def test_outside_a_task_torch_is_left_as_it_is(ray_cluster):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert use_assigned_cpus() == 1  # the driver holds no CPUs of its own: nothing to follow
    finally:
        torch.set_num_threads(before)


def fake_cluster(monkeypatch, nodes: list[dict], cores_here: int):
    import os

    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": r} for r in nodes])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {k: sum(r.get(k, 0) for r in nodes) for k in ("CPU", "GPU")})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores_here)), raising=False)


def test_the_demo_uses_every_core_of_a_local_machine(monkeypatch):
    from jobs.demo import machine_sizes

    fake_cluster(monkeypatch, [{"CPU": 4}], cores_here=2)  # connect() declares 2x the cores
    sizes = machine_sizes(40)
    assert sizes == {"cores": 2.0, "train_cpus": 2.0, "extract_workers": 2, "rows_per_shard": 10}
    assert machine_sizes(5)["extract_workers"] == 1  # a copy per core only with >= 8 rows for each


def test_the_demo_never_asks_a_node_for_what_it_does_not_have(monkeypatch):
    from jobs.demo import machine_sizes

    fake_cluster(monkeypatch, [{"CPU": 2}], cores_here=2)  # `ray start` on this machine: CPUs = cores
    sizes = machine_sizes(40)
    assert sizes["cores"] == 2 and sizes["train_cpus"] == 1  # training's data readers keep a CPU

    # a big CPU-only head beside two 8-CPU GPU nodes: GPU stages must fit on a GPU node
    fake_cluster(monkeypatch, [{"CPU": 32}, {"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}], cores_here=64)
    sizes = machine_sizes(400)
    assert sizes["cores"] == 8 and sizes["train_cpus"] == 7 and sizes["extract_workers"] == 2
    assert sizes["rows_per_shard"] == 16  # shards stay small enough to regenerate as one batch
