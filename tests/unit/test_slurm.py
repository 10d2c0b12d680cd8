"""mxlaunch.slurm on real inputs: Slurm's host-list syntax, environments copied from a real job
(Slurm 22.05: a batch script and an srun step of a 2-node job), the flags each engine gets, and
make_plan / `mxlaunch launch --dry-run` inside such an environment. The vLLM flags are checked
against vLLM's own parser (the installed 0.32), not against our idea of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mxlaunch.engines.registry import ENGINES
from mxlaunch.errors import UsageError
from mxlaunch.launch.decide import LaunchOptions, make_plan
from mxlaunch.slurm import (PORT_BASE, PORT_SPAN, SlurmEnv, adapt_launch, default_readers, dist_port,
                            expand_hostlist, read_env, readers_for)
from tests.helpers.cli import one_line_error, run_cli
from tests.unit.test_launch_plan import serve, write_checkpoint

# What a real 2-node job saw (printed by `env` in the batch script and in `srun` on node 1).
BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NODELIST": "gpu[01-02]",
         "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "1",
         "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu01"}
STEP1 = {**BATCH, "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURMD_NODENAME": "gpu02", "SLURM_STEP_ID": "0",
         "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2"}
STEP0 = {**STEP1, "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu01"}
ONE_NODE = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "cn017", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
            "SLURM_CPUS_ON_NODE": "32"}

SGL = ["python", "-m", "sglang.launch_server", "--model-path", "/m", "--tp", "8"]
SGL_NODE1_PORT = 21000 + 4242 % 8000
VLLM = ["vllm", "serve", "/m", "-tp", "8"]
VLLM_API = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "-tp", "8"]


# ---- host lists --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("node1", ["node1"]),
    ("n[8-10]", ["n8", "n9", "n10"]),  # no padding: widths grow
    ("n[08-10]", ["n08", "n09", "n10"]),  # padding kept
    ("n[001-002,010]", ["n001", "n002", "n010"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # several groups multiply, leftmost slowest
    ("a[1-2],b,c[05-06]-ib", ["a1", "a2", "b", "c05-ib", "c06-ib"]),  # a suffix: Slurm 22.05 refuses it, we read it
    ("n[1-2]-[3-4]", ["n1-3", "n1-4", "n2-3", "n2-4"]),
    ("n[1-2],n[2-3]", ["n1", "n2", "n2", "n3"]),  # duplicates stay, as in scontrol show hostnames
    ("gpu[3]", ["gpu3"]),
    ("x-1.cluster,y", ["x-1.cluster", "y"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, problem", [
    ("n[1-", "without ']'"), ("n]1", "without '['"), ("n[3-1]", "backwards"), ("n[a-b]", "not a number"),
    ("a,,b", "empty name"), ("n[[1]]", "nested"), ("", "empty"), ("n[1-2,]", "not a number"),
])
def test_bad_hostlists_name_the_problem(text: str, problem: str) -> None:
    with pytest.raises(UsageError) as err:
        expand_hostlist(text)
    assert problem in err.value.one_line()


# ---- the environment -----------------------------------------------------------------------------------

def test_outside_slurm_there_is_no_job() -> None:
    assert read_env({"HOME": "/x"}) is None
    out = adapt_launch(VLLM, "vllm", None, {})
    assert out.argv == VLLM and out.readers == default_readers() == 32 and out.to_json() is None
    assert adapt_launch(VLLM, "vllm", 3, {}).readers == 3


def test_batch_script_sees_the_job_and_a_step_sees_the_step() -> None:
    batch = read_env(BATCH)
    assert batch == SlurmEnv(job_id="4242", nnodes=2, node_rank=0, nodes=("gpu01", "gpu02"), cpus_on_node=1,
                             in_step=False, ntasks=None)
    step = read_env(STEP1)
    assert step is not None and step.in_step and step.node_rank == 1 and step.head == "gpu01" and step.ntasks == 2


def test_a_step_on_part_of_the_job_uses_the_steps_nodes() -> None:
    env = {**STEP1, "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "2",
           "SLURM_STEP_NODELIST": "gpu[03-04]"}
    step = read_env(env)
    assert step is not None and step.nodes == ("gpu03", "gpu04") and step.head == "gpu03"


@pytest.mark.parametrize("change, problem", [
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x'"),
    ({"SLURM_NODEID": "2"}, "not below the node count 2"),
    ({"SLURM_STEP_NUM_NODES": "3"}, "3 node(s)"),
    ({"SLURM_STEP_NODELIST": "gpu[01-"}, "cannot read the Slurm node list"),
    ({"SLURM_CPUS_ON_NODE": "0"}, "SLURM_CPUS_ON_NODE='0'"),
])
def test_a_broken_environment_is_a_one_line_usage_error(change: dict, problem: str) -> None:
    with pytest.raises(UsageError) as err:
        read_env({**STEP1, **change})
    assert problem in err.value.message and err.value.fix


@pytest.mark.parametrize("cpus, readers", [(1, 4), (2, 4), (3, 6), (8, 16), (16, 32), (128, 32)])  # 32: stage default
def test_readers_follow_the_nodes_cpus(cpus: int, readers: int) -> None:
    assert readers_for(cpus) == readers


def test_readers_from_slurm_unless_given() -> None:
    out = adapt_launch(VLLM, "vllm", None, ONE_NODE)
    assert out.readers == 32 and out.argv == VLLM and out.added == []
    assert "SLURM_CPUS_ON_NODE=32" in out.message
    assert adapt_launch(VLLM, "vllm", None, {**ONE_NODE, "SLURM_CPUS_ON_NODE": "2"}).readers == 4
    given = adapt_launch(VLLM, "vllm", 40, ONE_NODE)
    assert given.readers == 40 and "readers" not in given.message


# ---- the flags -------------------------------------------------------------------------------------------

def port_of(env: dict) -> int:
    return dist_port(read_env(env), env)


def test_sglang_gets_nnodes_rank_and_the_heads_address() -> None:
    port = port_of(STEP0)
    assert port == PORT_BASE + 4242 % PORT_SPAN
    assert adapt_launch(SGL, "sglang", None, STEP0).added == [
        "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", f"gpu01:{port}"]
    out = adapt_launch(SGL, "sglang", None, STEP1)
    assert out.argv == SGL + ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"gpu01:{port}"]
    assert "added --nnodes 2 --node-rank 1" in out.message and "job 4242" in out.message
    assert out.to_json()["added"] == out.added and out.to_json()["head"] == "gpu01"


def test_vllm_gets_master_addr_port_and_headless_on_the_other_nodes() -> None:
    port = port_of(STEP0)
    assert adapt_launch(VLLM, "vllm", None, STEP0).added == [
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "gpu01", "--master-port", str(port)]
    assert adapt_launch(VLLM, "vllm", None, STEP1).added == [
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "gpu01", "--master-port", str(port), "--headless"]


def test_vllm_api_server_form_cannot_be_a_worker_node() -> None:
    assert "--headless" not in adapt_launch(VLLM_API, "vllm", None, STEP0).added  # the head node is fine
    with pytest.raises(UsageError) as err:
        adapt_launch(VLLM_API, "vllm", None, STEP1)
    assert "ignores --headless" in err.value.message and "vllm serve" in err.value.fix


@pytest.mark.parametrize("extra, added", [
    (["--dist-init-addr", "10.0.0.1:5000"], ["--nnodes", "2", "--node-rank", "1"]),
    (["--dist-init-addr=10.0.0.1:5000", "--node-rank=1"], ["--nnodes", "2"]),
    (["--nnodes", "2", "--node-rank", "1", "--nccl-init-addr", "h:1"], []),  # an alias
    (["--nnod", "2"], ["--node-rank", "1", "--dist-init-addr", f"gpu01:{SGL_NODE1_PORT}"]),  # argparse abbreviation
    (["--nnodes", "1"], []),  # the command says one node: nothing is added
])
def test_sglang_flags_in_the_command_win(extra: list[str], added: list[str]) -> None:
    assert adapt_launch(SGL + extra, "sglang", None, STEP1).added == added


@pytest.mark.parametrize("extra, added_tail", [
    (["-r1", "-n2"], ["--master-addr", "gpu01", "--master-port", "P", "--headless"]),
    (["--master-addr", "ib-gpu01", "--master_port=9999"], ["--headless"]),
    (["--nnodes=1"], None),  # one node: nothing
    (["--node-rank", "0"], ["--master-addr", "gpu01", "--master-port", "P"]),  # its rank 0 wins: no --headless
    (["--headless"], ["--master-addr", "gpu01", "--master-port", "P"]),
])
def test_vllm_flags_in_the_command_win(extra: list[str], added_tail: list[str] | None) -> None:
    out = adapt_launch(VLLM + extra, "vllm", None, STEP1)
    if added_tail is None:
        assert out.added == [] and "already has" in out.message
        return
    expected = [str(port_of(STEP1)) if t == "P" else t for t in added_tail]
    assert out.added[-len(expected):] == expected
    assert out.argv == VLLM + extra + out.added


def test_vllm_config_file_counts_as_given(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("nnodes: 2\nmaster-addr: 10.1.1.1\nnode_rank: 1\n")
    argv = VLLM + ["--config", str(config)]
    given = ENGINES["vllm"].explicit_fields(argv)
    assert {k: given[k] for k in ("nnodes", "node_rank", "master_addr")} == {
        "nnodes": 2, "node_rank": 1, "master_addr": "10.1.1.1"}
    assert adapt_launch(argv, "vllm", None, STEP1).added == ["--master-port", str(port_of(STEP1)), "--headless"]


def test_sglang_config_file_counts_as_given(tmp_path: Path) -> None:
    config = tmp_path / "sglang.yaml"
    config.write_text("dist-init-addr: 10.2.2.2:7000\ntp-size: 8\n")
    assert adapt_launch(SGL + ["--config", str(config)], "sglang", None, STEP1).added == [
        "--nnodes", "2", "--node-rank", "1"]


def test_overrides_for_address_and_port() -> None:
    env = {**STEP1, "MXLAUNCH_DIST_ADDR": "10.0.0.5", "MXLAUNCH_DIST_PORT": "31337"}
    assert adapt_launch(SGL, "sglang", None, env).added[-2:] == ["--dist-init-addr", "10.0.0.5:31337"]
    with pytest.raises(UsageError) as err:
        adapt_launch(SGL, "sglang", None, {**STEP1, "MXLAUNCH_DIST_PORT": "80"})
    assert "MXLAUNCH_DIST_PORT='80'" in err.value.message


def test_every_node_of_a_job_agrees_and_jobs_differ() -> None:
    ports = {port_of({**STEP1, "SLURM_NODEID": str(n)}) for n in (0, 1)}
    assert len(ports) == 1
    assert port_of({**STEP1, "SLURM_JOB_ID": "4243"}) != ports.pop()
    assert PORT_BASE <= port_of({**STEP1, "SLURM_JOB_ID": "99999999"}) < PORT_BASE + PORT_SPAN


def test_batch_script_of_a_multinode_job_adds_nothing_and_says_why() -> None:
    out = adapt_launch(SGL, "sglang", None, BATCH)
    assert out.added == [] and out.argv == SGL
    assert "outside srun" in out.message and "launch-multinode.sbatch" in out.message


def test_several_tasks_per_node_are_refused() -> None:
    with pytest.raises(UsageError) as err:
        adapt_launch(SGL, "sglang", None, {**STEP1, "SLURM_STEP_NUM_TASKS": "4"})
    assert "4 tasks on 2 nodes" in err.value.message and "--ntasks-per-node=1" in err.value.fix


def test_an_unknown_engine_is_left_alone() -> None:
    assert adapt_launch(["bash", "-c", "x"], None, None, STEP1).added == []


def test_the_vllm_flags_mean_what_we_think_to_vllms_own_parser() -> None:
    """The installed vLLM (0.32) parses the added flags into the multi-node settings."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(description="vLLM CLI")
    parser = ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    out = adapt_launch(VLLM, "vllm", None, STEP1)
    args = parser.parse_args(out.argv[2:])
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.headless) == (
        2, 1, "gpu01", port_of(STEP1), True)


# ---- make_plan and the CLI inside a Slurm step ----------------------------------------------------------------

def test_make_plan_in_a_step_places_this_node_and_records_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_checkpoint(tmp_path / "model")
    for key, value in {**STEP0, "SLURM_CPUS_ON_NODE": "2"}.items():
        monkeypatch.setenv(key, value)
    # the api_server form works on the head node; node 1 needs `vllm serve` (see above)
    opts = LaunchOptions(artifact_path=tmp_path / "store")
    plan = make_plan(serve(model, "-tp", "2"), opts)
    assert plan.spec.nnodes == 2 and plan.spec.node_rank == 0
    assert [r["rank"] for r in plan.local_ranks] == [0]  # this node stages its own rank only
    i = plan.argv.index("--master-addr")
    assert plan.argv[i:i + 4] == ["--master-addr", "gpu01", "--master-port", str(port_of(STEP0))]
    assert opts.readers == 4 and opts.readers_given is False  # sized here: a store on Lustre may raise it
    record = plan.to_json()["slurm"]
    assert record["added"][:4] == ["--nnodes", "2", "--node-rank", "0"] and record["readers"] == 4


def test_cli_dry_run_shows_the_slurm_record_and_a_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_checkpoint(tmp_path / "model")
    for key, value in STEP0.items():
        monkeypatch.setenv(key, value)
    argv = ["launch", "--dry-run", "--artifact-path", str(tmp_path / "store"), "--", *serve(model, "-tp", "2")]
    result = run_cli(*argv[:2], "--json", *argv[2:])
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["schema"] == 1 and doc["node_rank"] == 0 and doc["nnodes"] == 2
    assert doc["slurm"]["job_id"] == "4242" and "--master-port" in doc["slurm"]["added"]
    text = run_cli(*argv)
    assert text.returncode == 0 and "mxlaunch slurm: " in text.stderr and "added --nnodes 2" in text.stderr


def test_cli_dry_run_of_an_sglang_command_on_node_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own parser (it requires --dist-init-addr with --nnodes > 1) takes the added flags, and
    node 1 plans its own TP rank."""
    model = write_checkpoint(tmp_path / "model")
    for key, value in STEP1.items():
        monkeypatch.setenv(key, value)
    result = run_cli("launch", "--dry-run", "--json", "--artifact-path", str(tmp_path / "store"), "--",
                     "python", "-m", "sglang.launch_server", "--model-path", str(model), "--tp", "2")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["engine"] == "sglang" and (doc["nnodes"], doc["node_rank"]) == (2, 1)
    assert [r["rank"] for r in doc["local_ranks"]] == [1]
    assert doc["argv"][-6:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"gpu01:{SGL_NODE1_PORT}"]


def test_cli_bad_slurm_environment_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_checkpoint(tmp_path / "model")
    for key, value in {**STEP1, "SLURM_STEP_NODELIST": "gpu[02-01]"}.items():
        monkeypatch.setenv(key, value)
    result = run_cli("launch", "--dry-run", "--", *serve(model, "-tp", "2"))
    assert result.returncode == 2
    assert "runs backwards" in one_line_error(result)
