"""The coding agents people run, unmodified, against a live server: Codex CLI (`codex exec`, its
default configuration with a custom provider on /v1/responses) and Claude Code (`claude -p` with
ANTHROPIC_BASE_URL on /v1/messages), both from npm at pinned versions (tests/npm_clients.py).

The model is a tiny scripted one (scripted_model.py) with a Hermes-style chat template, so the
server selects its real tool-call format and grammar: where the prompt ends a user's turn it calls
tools, where it ends after tool results it answers "Done." Each client must run the calls it gets
and send their outputs back; a recording proxy between client and server shows every request
and reply, and each must be a 2xx.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from npm_clients import CLAUDE_CODE, CODEX, RecordingProxy, npm_client
from scripted_model import scripted_gguf, scripted_vocab
from server_process import ServerProcess

# Hermes-style (Qwen's) tool declarations and calls. The generation prompt ends in "\n" after a
# user's turn and in " " after tool results: the scripted model, which sees only the last token,
# calls tools on the first and answers on the second.
TEMPLATE = """\
{%- if tools and messages[0].role != 'system' -%}{{ '<|im_start|>system\\n<tools>\\n' }}\
{%- for t in tools %}{{ t | tojson + '\\n' }}{% endfor %}{{ '</tools><|im_end|>\\n' }}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{ '<|im_start|>system\\n' + m.content }}\
{%- if loop.first and tools %}{{ '\\n<tools>\\n' }}{% for t in tools %}{{ t | tojson + '\\n' }}{% endfor %}\
{{ '</tools>' }}{% endif %}{{ '<|im_end|>\\n' }}
{%- elif m.role == 'tool' -%}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' + (m.content or '') }}\
{%- for c in m.tool_calls or [] %}{{ '<tool_call>\\n' + c.function | tojson + '\\n</tool_call>' }}{% endfor %}\
{{ '<|im_end|>\\n' }}
{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant' + (' ' if messages[-1].role == 'tool' else '\\n') }}\
{%- endif -%}"""
CODEX_OK, CLAUDE_OK = "vinoserve-codex-ok", "vinoserve-claude-ok"
# A call's tokens. The grammar forces `{"name": "` after the opening tag, and llguidance then takes
# only the tokens the tokenizer would write for it (NAME); the rest of a call is one token, from
# the name (a choice) through its closing tag.
OPEN, NAME, DONE = "<tool_call>\n", '{"name": "', "Done."
NEXT = "\n" + OPEN + NAME  # a second call in the same reply


def _call(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments})[len(NAME):] + "\n</tool_call>"


# Codex: its shell tool, then a function of its multi_agent_v1 namespace (flattened by the server).
EXEC = _call("exec_command", {"cmd": f"echo {CODEX_OK}"})
CLOSE = _call("multi_agent_v1__close_agent", {"target": "no-such-agent"})
BASH = _call("Bash", {"command": f"echo {CLAUDE_OK}"})  # Claude Code's
VOCAB = scripted_vocab([OPEN, NAME, NEXT, DONE, EXEC, CLOSE, BASH], ["<|im_start|>", "<|im_end|>"], "<|im_end|>",
                       TEMPLATE)
SCRIPT = {
    "Ċ": [OPEN], "Ġ": [DONE], DONE: ["<|im_end|>"], OPEN: [NAME],
    NAME: [EXEC, BASH],  # the grammar allows only the request's own tools: Codex's first, else Claude Code's
    EXEC: [NEXT], NEXT: [CLOSE], CLOSE: ["<|im_end|>"], BASH: ["<|im_end|>"],
}
TIMEOUT = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The clients' prompts are 30-60 kB, a token a byte here: the context holds them.
    gguf = scripted_gguf(VOCAB, SCRIPT, tmp_path_factory.mktemp("agents") / "scripted.gguf", context=131072)
    log = gguf.parent / "server.log"
    srv = ServerProcess("--model", str(gguf), "--inference-precision", "f32", "--kv-cache-precision", "f32",
                        "--kv-cache-size", "0.25", log_path=log).wait_ready()
    yield srv
    assert srv.terminate() == 0
    assert "Traceback" not in log.read_text()


def _all_2xx(proxy: RecordingProxy) -> None:
    assert proxy.exchanges and all(200 <= e.status < 300 for e in proxy.exchanges), \
        [(e.method, e.path, e.status, e.reply[:300]) for e in proxy.exchanges if e.status >= 300]


def test_codex_exec_runs_a_call_and_sends_its_output_back(server, tmp_path):
    codex = npm_client(*CODEX)
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    with RecordingProxy(server.url) as proxy:
        # What a user puts in ~/.codex/config.toml (docs/agent-apis.md): everything else is Codex's default.
        (home / "config.toml").write_text(f'model = "scripted"\nmodel_provider = "vinoserve"\n\n'
                                          f'[model_providers.vinoserve]\nname = "vinoserve"\n'
                                          f'base_url = "{proxy.url}/v1"\nwire_api = "responses"\n')
        r = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "--json", "Check that the shell works."],
                           cwd=work, env={**os.environ, "CODEX_HOME": str(home)}, capture_output=True, text=True,
                           timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _all_2xx(proxy)
    turns = [e for e in proxy.exchanges if e.path.startswith("/v1/responses")]
    assert len(turns) == 2, [e.path for e in proxy.exchanges]
    first, second = (t.body for t in turns)
    # Codex's default request, as issue 33 found it: namespace and web_search tools, and the rest.
    kinds = {t["type"] for t in first["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds
    assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
    assert first["stream"] and first["prompt_cache_key"] and first["client_metadata"]
    # The first reply's calls, namespaced as Codex expects them.
    calls = [e["item"] for e in turns[0].events() if e["type"] == "response.output_item.done"
             and e["item"]["type"] == "function_call"]
    assert [(c["name"], c.get("namespace")) for c in calls] == [("exec_command", None),
                                                               ("close_agent", "multi_agent_v1")]
    # Codex ran both and sent their outputs back, after the calls as it got them.
    ids = [c["call_id"] for c in calls]
    echoed = [(i["name"], i.get("namespace")) for i in second["input"]
              if i.get("type") == "function_call" and i["call_id"] in ids]
    assert echoed == [("exec_command", None), ("close_agent", "multi_agent_v1")]
    outputs = {i["call_id"]: _output_text(i["output"]) for i in second["input"]
               if i.get("type") == "function_call_output"}
    assert CODEX_OK in outputs[ids[0]], outputs
    assert "unsupported call" not in outputs[ids[1]], outputs  # routed to its namespace's tool
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    ran = [e["item"] for e in events if e.get("type") == "item.completed"
           and e["item"].get("type") == "command_execution"]
    assert ran and CODEX_OK in ran[0]["aggregated_output"], events
    assert any(e.get("type") == "item.completed" and e["item"].get("text") == DONE for e in events), events


def _output_text(output: str | list) -> str:
    return output if isinstance(output, str) else "".join(p.get("text", "") for p in output)


def test_claude_code_runs_a_call_and_sends_its_result_back(server, tmp_path):
    claude = npm_client(*CLAUDE_CODE)
    home = tmp_path / "claude-home"
    home.mkdir()
    with RecordingProxy(server.url) as proxy:
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": proxy.url,
               "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": "scripted", "ANTHROPIC_SMALL_FAST_MODEL": "scripted",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
        r = subprocess.run([str(claude), "-p", "Check that the shell works.", "--tools", "Bash,Read",
                            "--allowedTools", "Bash(echo:*)", "--output-format", "json"],
                           cwd=home, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                           stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _all_2xx(proxy)
    turns = [e for e in proxy.exchanges if e.path.startswith("/v1/messages?") or e.path == "/v1/messages"]
    assert len(turns) >= 2, [e.path for e in proxy.exchanges]
    first, second = turns[0], turns[-1]
    assert first.body["stream"] and {"Bash", "Read"} <= {t["name"] for t in first.body["tools"]}
    uses = [e["content_block"] for e in first.events() if e["type"] == "content_block_start"
            and e["content_block"]["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["Bash"]
    results = [b for m in second.body["messages"] if isinstance(m["content"], list) for b in m["content"]
               if b["type"] == "tool_result" and b["tool_use_id"] == uses[0]["id"]]
    assert results and CLAUDE_OK in json.dumps(results[0]["content"])
    # Prompt caching: the second turn reads the first's prompt (~14k tokens) from the prefix cache.
    usage = next(e for e in second.events() if e["type"] == "message_delta")["usage"]
    assert usage["cache_read_input_tokens"] > 10000 and usage["input_tokens"] < 1000, usage
    # Every other request it made (count_tokens, when it counts) was answered too (_all_2xx above).
    assert {e.path.split("?")[0] for e in proxy.exchanges} <= {"/v1/messages", "/v1/messages/count_tokens"}
    assert json.loads(r.stdout)["result"] == DONE
