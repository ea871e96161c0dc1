"""Publishing: the dry-run folder, and the upload call sequence against a small local Hub stand-in on
127.0.0.1 (HF_ENDPOINT). Nothing here talks to the real Hub."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import hf_posenc
from hf_posenc import PosEncError
from tiny_models import random_ids, tiny_model

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(BaseHTTPRequestHandler):
    """The endpoints huggingface_hub's create_repo / create_branch / upload_folder use, every file uploaded
    "regular" (inline in the commit). Records each request; anything else is a 404."""

    def log_message(self, *args):
        pass

    def _reply(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.calls.append(("GET", self.path, None))
        self._reply(404, {"error": "not in the fake hub"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = self.path.split("?")[0]
        self.server.calls.append(("POST", path, self.headers.get("authorization")))
        if self.headers.get("authorization") != "Bearer hf_test_token":
            return self._reply(401, {"error": "Invalid credentials"})
        parts = path.strip("/").split("/")
        if path == "/api/validate-yaml":  # upload_folder has the Hub check README.md's metadata
            self.server.validated.append(json.loads(raw)["content"])
            return self._reply(200, {})
        if path == "/api/repos/create":
            request = json.loads(raw)
            self.server.created.append(request)
            return self._reply(200, {"url": f"{self.server.endpoint}/{request['organization']}/{request['name']}"})
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "branch":
            self.server.branches.append(parts[5])
            return self._reply(200, {})
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
            files = json.loads(raw)["files"]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
            lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                     for line in lines if line["key"] == "file"}
            self.server.commits.append({"revision": "/".join(parts[5:]), "header": header, "files": files})
            repo = "/".join(parts[2:4])
            return self._reply(200, {"commitUrl": f"{self.server.endpoint}/{repo}/commit/{SHA}", "commitOid": SHA,
                                     "pullRequestUrl": None})
        self._reply(404, {"error": f"not in the fake hub: {path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.timeout = 5
    server.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    server.calls, server.created, server.branches, server.commits, server.validated = [], [], [], [], []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # conftest sets offline mode
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def checkpoint(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", trainable=True)
    with torch.no_grad():
        hf_posenc.get_positional_module(model).slopes.mul_(1.5)
    directory = tmp_path / "checkpoint"
    model.save_pretrained(directory)
    return model, directory


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_dry_run_writes_the_folder_and_it_reloads_to_identical_logits(checkpoint, tmp_path):
    model, directory = checkpoint
    before = snapshot(directory)
    files = hf_posenc.push_to_hub(directory, "acme/tiny-alibi", dry_run=tmp_path / "upload", standalone=True)
    assert files == sorted(snapshot(tmp_path / "upload"))
    assert {"README.md", "config.json", "model.safetensors", "posenc_config.json", "modeling_posenc.py"} <= set(files)
    assert snapshot(directory) == before  # the local checkpoint is only read
    ids = random_ids(1, 9)
    with torch.no_grad():
        assert torch.equal(hf_posenc.from_pretrained(tmp_path / "upload")(ids).logits, model(ids).logits)
    assert "acme/tiny-alibi" in (tmp_path / "upload" / "README.md").read_text()


def test_upload_call_sequence(fake_hub, checkpoint, tmp_path):
    model, directory = checkpoint
    before = snapshot(directory)
    info = hf_posenc.push_to_hub(directory, "acme/tiny-alibi", token="hf_test_token", private=True,
                                 revision="experiment", commit_message="Add ALiBi")
    assert info.oid == SHA
    assert [(c["name"], c["organization"], c["visibility"]) for c in fake_hub.created] == [
        ("tiny-alibi", "acme", "private")]
    assert fake_hub.branches == ["experiment"]
    (commit,) = fake_hub.commits
    assert commit["revision"] == "experiment" and commit["header"]["summary"] == "Add ALiBi"
    dry = tmp_path / "dry"
    hf_posenc.push_to_hub(directory, "acme/tiny-alibi", dry_run=dry)
    assert commit["files"] == snapshot(dry)  # exactly the dry-run folder was uploaded
    assert [(m, p) for m, p, _ in fake_hub.calls] == [
        ("POST", "/api/repos/create"), ("POST", "/api/models/acme/tiny-alibi/branch/experiment"),
        ("POST", "/api/validate-yaml"), ("POST", "/api/models/acme/tiny-alibi/preupload/experiment"),
        ("POST", "/api/models/acme/tiny-alibi/commit/experiment")]
    assert fake_hub.validated == [commit["files"]["README.md"].decode()]
    assert snapshot(directory) == before


def test_a_patched_model_is_uploaded_directly(fake_hub):
    model = hf_posenc.patch_model(tiny_model("gpt2"), "sinusoidal")
    hf_posenc.push_to_hub(model, "acme/tiny-gpt2", token="hf_test_token")
    files = fake_hub.commits[0]["files"]
    assert json.loads(files["posenc_config.json"])["method"] == "sinusoidal"
    assert fake_hub.commits[0]["revision"] == "main" and fake_hub.branches == []


def test_save_pretrained_with_push_to_hub_saves_then_uploads(fake_hub, tmp_path):
    """save_pretrained(push_to_hub=True, standalone=True) on a patched model: the library's publish step
    (checkpoints/hub.py: publish_saved) adds the standalone code, then uploads the saved folder."""
    model = hf_posenc.patch_model(tiny_model("gpt2"), "alibi")
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, standalone=True, repo_id="acme/saved-alibi",
                          token="hf_test_token", commit_message="From save_pretrained")
    assert (tmp_path / "saved" / "modeling_posenc.py").is_file()
    (commit,) = fake_hub.commits
    assert commit["header"]["summary"] == "From save_pretrained"
    assert {"posenc_config.json", "modeling_posenc.py", "model.safetensors", "README.md"} <= set(commit["files"])
    assert [(c["name"], c["organization"]) for c in fake_hub.created] == [("saved-alibi", "acme")]


def test_rejected_token_is_a_clear_error(fake_hub, checkpoint):
    with pytest.raises(PosEncError, match="refused the token"):
        hf_posenc.push_to_hub(checkpoint[1], "acme/tiny-alibi", token="hf_wrong")


def test_no_token(monkeypatch, checkpoint, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_home"))
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    with pytest.raises(PosEncError, match="No Hugging Face token"):
        hf_posenc.push_to_hub(checkpoint[1], "acme/tiny-alibi")


@pytest.mark.parametrize("repo_id", ["tiny-alibi", "acme/tiny alibi", "a/b/c", "acme/--bad", ""])
def test_malformed_repo_id(checkpoint, repo_id):
    with pytest.raises(PosEncError, match="Malformed repo id"):
        hf_posenc.push_to_hub(checkpoint[1], repo_id, token="hf_test_token")


def test_network_down(monkeypatch, checkpoint):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    before = snapshot(checkpoint[1])
    with pytest.raises(PosEncError, match="Is the network up"):
        hf_posenc.push_to_hub(checkpoint[1], "acme/tiny-alibi", token="hf_test_token")
    assert snapshot(checkpoint[1]) == before


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(PosEncError, match="not an hf_posenc checkpoint"):
        hf_posenc.push_to_hub(tmp_path, "acme/x", dry_run=tmp_path / "out")


def load_publish_script():
    from hf_posenc.tools.cli import main

    return lambda argv: main(["publish", *argv])  # `hf-posenc publish` (was scripts/publish.py)


def test_publish_script(fake_hub, checkpoint, tmp_path, monkeypatch, capsys):
    publish = load_publish_script()
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert publish([str(checkpoint[1]), "acme/tiny-alibi", "--dry-run", str(tmp_path / "dry")]) == 0
    listing = capsys.readouterr().out
    assert "model.safetensors" in listing and "README.md" in listing
    assert fake_hub.commits == []
    assert publish([str(checkpoint[1]), "not a repo"]) == 2
    assert "Malformed repo id" in capsys.readouterr().err
    assert publish([str(checkpoint[1]), "acme/tiny-alibi", "--private", "--message", "via script"]) == 0
    assert fake_hub.commits[0]["header"]["summary"] == "via script"
    assert fake_hub.created[0]["visibility"] == "private"
    assert sorted(fake_hub.commits[0]["files"]) == sorted(snapshot(tmp_path / "dry"))
