"""A real `streamrft serve-env` subprocess driven by RemoteEnvironment: episodes over ZeroMQ and HTTP,
idempotent retries, kill -9 + restart on the same port mid-run (every episode ends exactly once), and
bad input (oversized frame, unknown environment, wrong environment, out-of-order turn)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from protocols import decode, encode
from protocols.env import EnvReply, EnvReset, EnvStep
from streamrft.envs.remote import EnvServiceError, RemoteEnvClient
from tests.integration._services import ServiceProcess, services_fixture
from tests.ports import free_port

pytestmark = pytest.mark.slow  # real processes (each test takes 1-2 s)

ROOT = Path(__file__).resolve().parents[2]

ENVS = textwrap.dedent(
    """
    import asyncio, os
    from streamrft.envs import EnvStep

    class Counting:
        '''Deterministic: observation k names the row, the step count and the action; done after `turns`.'''
        def __init__(self, turns=3, delay=0.0):
            self.turns, self.delay = turns, delay

        async def reset(self, row):
            self.n, self.x = 0, row.get("x", row.get("sample_id"))
            return f"start {self.x}"

        async def step(self, action):
            self.n += 1  # a turn stepped twice on one instance shows up as a wrong count
            await asyncio.sleep(self.delay)
            return EnvStep(observation=f"obs {self.x} {self.n} {action}", reward=float(self.n),
                           done=self.n >= self.turns, info={"n": self.n})

        async def close(self):
            pass

    class Hanging(Counting):
        async def step(self, action):
            await asyncio.sleep(3600)

    class Drifting(Counting):
        '''Not deterministic across processes: the observation holds the service's pid.'''
        async def step(self, action):
            out = await super().step(action)
            out.observation += f" pid {os.getpid()}"
            return out
    """
)


def serve_env(*args: str) -> ServiceProcess:
    """One `streamrft serve-env` subprocess, running and ready."""
    return ServiceProcess("serve-env", ["streamrft.cli", "serve-env", *args], stop_timeout_s=10)


services = services_fixture(serve_env)


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs_under_test.py"
    path.write_text(ENVS)
    return path


async def run_episode(client: RemoteEnvClient, i: int, answered: list, max_turns: int = 10) -> tuple[str, list]:
    """('completed', [(observation, reward), ...]) or ('failed:<reason>', turns so far)."""
    env = client.factory()()
    turns: list = []
    try:
        turns.append((await env.reset({"x": i}), 0.0))
        for k in range(1, max_turns + 1):
            out = await env.step(f"a{i}.{k}")
            turns.append((out.observation, out.reward))
            answered.append(i)
            if out.done:
                return "completed", turns
        return "completed", turns
    except EnvServiceError as exc:
        return f"failed:{exc.reason}", turns
    finally:
        await env.close()


def expected_turns(i: int, turns: int) -> list:
    return [(f"start {i}", 0.0)] + [(f"obs {i} {k} a{i}.{k}", float(k)) for k in range(1, turns + 1)]


async def run_with_restart(env_file: Path, cls: str, n: int, turns: int) -> tuple[list, RemoteEnvClient, list[ServiceProcess]]:
    port = free_port()
    args = ("--env", f"{env_file}:{cls}", "--bind", f"tcp://127.0.0.1:{port}",
            "--env-kwargs", json.dumps({"turns": turns, "delay": 0.05}))
    loop = asyncio.get_running_loop()
    first = await loop.run_in_executor(None, lambda: serve_env(*args))
    client = RemoteEnvClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5, retries=10, rank=1)
    answered: list[int] = []
    tasks = [asyncio.create_task(run_episode(client, i, answered)) for i in range(n)]
    # kill -9 mid-run: once n / 2 steps are answered, while most episodes are still in flight
    while len(answered) < n // 2:
        await asyncio.sleep(0.005)
    first.proc.kill()
    first.proc.wait(10)
    killed_at = len(answered)
    second = await loop.run_in_executor(None, lambda: serve_env(*args))
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert killed_at < n * turns // 2, "the kill came late in the run: little was tested"
    await client.close()
    return results, client, [first, second]


def test_a_killed_and_restarted_service_loses_no_episode_and_steps_none_twice(env_file):
    n, turns = 12, 4
    results, client, procs = asyncio.run(run_with_restart(env_file, "Counting", n, turns))
    try:
        # every episode ended exactly once, completed, with exactly the turns a fresh environment gives:
        # a turn lost or stepped twice would change the step count in an observation or a reward
        assert [r[0] for r in results] == ["completed"] * n
        for i, (_, got) in enumerate(results):
            assert got == expected_turns(i, turns), i
        assert sum(sum(r for _, r in got) for _, got in results) == n * sum(range(1, turns + 1))
        assert client.n_rebuilt >= 1 and client.n_failed == 0
        # the restarted service saw the rebuilt episodes' unknown steps and answers them all
        second = procs[1]
        second.stop()
        stopped = [line for line in second.lines if line.startswith("serve-env: stopped on SIGTERM")]
        assert stopped and " unknown episodes" in stopped[0] and " 0 unknown episodes" not in stopped[0], second.lines
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def test_a_non_deterministic_environment_fails_its_lost_episodes_with_env_lost(env_file):
    n, turns = 8, 4
    results, client, procs = asyncio.run(run_with_restart(env_file, "Drifting", n, turns))
    try:
        outcomes = [r[0] for r in results]
        assert len(outcomes) == n and set(outcomes) <= {"completed", "failed:env_lost"}
        lost = outcomes.count("failed:env_lost")
        assert lost >= 1 and client.failed_by_reason == {"env_lost": lost} and client.n_failed == lost
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def _request(addr: str, msg, raw: bytes | None = None) -> EnvReply:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send(raw if raw is not None else encode(msg))
        assert sock.poll(10_000), "no reply"
        return decode(sock.recv(), EnvReply)
    finally:
        sock.close(0)


def test_retries_are_answered_from_the_cache_and_bad_requests_get_exact_errors(env_file, services):
    port, http_port = free_port(), free_port()
    svc = services("--env", f"{env_file}:Counting", "--bind", f"tcp://127.0.0.1:{port}",
                   "--http", f"127.0.0.1:{http_port}", "--max-message-bytes", "4096", "--env-kwargs", '{"turns": 2}')
    addr = f"tcp://127.0.0.1:{port}"
    assert _request(addr, EnvReset(episode_id="e1", row={"x": 7})).observation == "start 7"
    once = _request(addr, EnvStep(episode_id="e1", turn=1, action="go"))
    again = _request(addr, EnvStep(episode_id="e1", turn=1, action="go"))  # a retry: same reply, not stepped again
    assert once == again and once.observation == "obs 7 1 go" and once.info == {"n": 1}
    other = _request(addr, EnvStep(episode_id="e1", turn=1, action="other"))
    assert other.code == "bad_request" and other.error == (
        "episode 'e1' turn 1 was already requested with another action; a retry must resend the same one")
    skip = _request(addr, EnvStep(episode_id="e1", turn=3, action="x"))
    assert skip.error == "episode 'e1': turn 3 arrived but the environment is at turn 2"
    unknown = _request(addr, EnvStep(episode_id="nope", turn=1, action="x"))
    assert unknown.code == "unknown_episode" and unknown.error.startswith("episode 'nope' is not open on this service")
    wrong_env = _request(addr, EnvReset(episode_id="e2", row={}, env="calculator"))
    assert wrong_env.code == "bad_request" and wrong_env.error == (
        f"this service runs environment '{env_file}:Counting' (serve-env --env), the client asks for 'calculator' (env.name)")
    big = _request(addr, None, raw=b"\x00" * 5000)
    assert big.code == "bad_request" and big.error == "request of 5000 bytes exceeds --max-message-bytes=4096"
    junk = _request(addr, None, raw=b"\xc1junk")
    assert junk.code == "bad_request" and junk.error.startswith("malformed frame (not a msgpack message)")
    # HTTP: the same messages as JSON; /health counts one step for e1 although it was asked twice
    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/", data=json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, reply = post({"kind": "EnvStep", "episode_id": "e1", "turn": 2, "action": "end"})
    assert status == 200 and reply["observation"] == "obs 7 2 end" and reply["done"] is True
    status, reply = post({"kind": "EnvStep", "episode_id": "e1", "turn": 3, "action": "more"})
    assert status == 400 and reply["error"] == "episode 'e1' ended at turn 2; turn 3 cannot follow"
    assert post({"kind": "EnvStep", "episode_id": "zz", "turn": 1, "action": "x"})[0] == 404
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert (health["status"], health["resets"], health["steps"], health["episodes"]) == ("ok", 1, 2, 1)
    assert health["cached"] == 1
    assert svc.stop() == 0


def test_an_unknown_environment_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "streamrft.cli", "serve-env", "--env", "nosuch"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        "serve-env: error: --env 'nosuch': env.name 'nosuch' is neither a registered environment (")


def test_an_unreachable_service_fails_the_call_within_its_deadline_naming_stage_rank_and_address():
    async def go():
        client = RemoteEnvClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.2, retries=2, rank=3)
        env = client.factory()()
        start = time.monotonic()
        with pytest.raises(EnvServiceError) as info:
            await env.reset({"x": 1})
        took = time.monotonic() - start
        await env.close()
        await client.close()
        return info.value, took, client

    exc, took, client = asyncio.run(go())
    assert exc.reason == "env_unreachable" and took < client.deadline_s
    assert str(exc).startswith(f"env_unreachable: env stage, rank 3, service {client.address}: EnvReset of episode ")
    # 3 attempts of the reset, 1 of the close (which is not a failed sample: not counted as one)
    assert client.failed_by_reason == {"env_unreachable": 1} and client.n_failed == 1 and client.n_timeouts == 4


def test_the_http_client_runs_episodes_and_a_hanging_step_fails_with_env_timeout(env_file, services):
    port, http_port = free_port(), free_port()
    services("--env", f"{env_file}:Counting", "--bind", f"tcp://127.0.0.1:{port}", "--http", f"127.0.0.1:{http_port}",
             "--env-kwargs", '{"turns": 2}')
    hang_port = free_port()
    services("--env", f"{env_file}:Hanging", "--bind", f"tcp://127.0.0.1:{hang_port}", "--step-timeout-s", "0.3")

    async def go():
        http = RemoteEnvClient(f"http://127.0.0.1:{http_port}/", timeout_s=5, retries=1)
        done = await run_episode(http, 5, [])
        hang = RemoteEnvClient(f"tcp://127.0.0.1:{hang_port}", timeout_s=5, retries=1, rank=2)
        failed = await run_episode(hang, 6, [])
        await http.close()
        await hang.close()
        return done, failed, hang

    done, failed, hang = asyncio.run(go())
    assert done == ("completed", expected_turns(5, 2))
    assert failed == ("failed:env_timeout", [("start 6", 0.0)]) and hang.failed_by_reason == {"env_timeout": 1}


def test_a_training_run_survives_its_env_service_killed_and_restarted_with_every_sample_trained(env_file, tmp_path):
    """The acceptance run: `streamrft train` with env.address on a serve-env that is killed with SIGKILL
    in the middle of step 2's episodes and restarted on the same port; the run ends with exit 0 and every
    admitted sample trained (none failed, none counted twice), and the restarted service saw the steps of
    episodes it did not hold (they were rebuilt, not failed)."""
    if not (ROOT / "runs/arith/sft/model.safetensors").exists():
        pytest.skip("the arith model is not prepared (python pipelines/arith/prepare.py)")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    port, http_port = free_port(), free_port()
    service_args = ("--env", f"{env_file}:Counting", "--bind", f"tcp://127.0.0.1:{port}",
                    "--env-kwargs", '{"turns": 2, "delay": 0.1}')
    first = serve_env(*service_args, "--http", f"127.0.0.1:{http_port}")
    restarted: list[ServiceProcess] = []

    def kill_in_step_2() -> None:
        """Step 1 makes 16 episodes of 2 env steps; kill once 8 of step 2's 32 steps are answered."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as resp:
                    if json.loads(resp.read())["steps"] >= 40:
                        break
            except OSError:
                pass
            time.sleep(0.01)
        first.proc.kill()
        first.proc.wait(10)
        restarted.append(serve_env(*service_args))

    killer = threading.Thread(target=kill_in_step_2, daemon=True)
    killer.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    train = subprocess.Popen(
        [sys.executable, "-m", "streamrft.cli", "train", "pipelines/arith/config.yaml", f"output_dir={tmp_path / 'run'}",
         "checkpoint.resume=never", "train.max_steps=3", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
         "data.eval_size=8", f"env.name={env_file}:Counting", f"env.address=tcp://127.0.0.1:{port}",
         "env.max_tokens=64", "env.timeout_s=1", "env.retries=20", f"data.chat_template={template}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [line.rstrip("\n") for line in train.stdout]
        assert train.wait(60) == 0, "\n".join(lines[-60:])
        killer.join(30)
        assert restarted and restarted[0].stop() == 0, lines[-20:]
    finally:
        train.kill()
        for svc in (first, *restarted):
            svc.stop(signal.SIGKILL)
    summary = json.loads(next(line for line in lines if line.startswith("summary: "))[len("summary: "):])
    assert summary["steps"] == 3 and summary["samples_admitted"] == summary["samples_trained"] == 3 * 4 * 4, summary
    stopped = restarted[0].lines[-1]
    assert stopped.startswith("serve-env: stopped on SIGTERM") and " 0 unknown episodes" not in stopped, stopped
