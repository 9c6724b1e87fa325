"""The command line a result file records pastes back as the arguments that ran."""

import shlex

from bench.common import command


def test_the_recorded_command_splits_back_into_its_arguments():
    argv = ["--rows", "10000", "--note", "a shared machine; load 9-12", "--out", "it's here"]
    recorded = command("extract_memory", argv)
    assert shlex.split(recorded) == ["python", "-m", "bench.extract_memory", *argv]
    assert command("decode", ["--num-prompts", "2"]) == "python -m bench.decode --num-prompts 2"
