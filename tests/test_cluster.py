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


def test_outside_a_task_torch_is_left_as_it_is(ray_cluster):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert use_assigned_cpus() == 1  # the driver holds no CPUs of its own: nothing to follow
    finally:
        torch.set_num_threads(before)
