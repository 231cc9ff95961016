"""The router's admin key and LoRA root: the settings that turn admin operations on, what a call needs to pass,
which adapter paths a runtime load may name, and that ``kvmesh up`` and ``kvmesh config show`` carry them."""

from __future__ import annotations

import json
import os

import pytest
from kvmesh.settings import RouterSettings

from app.cli import main as kvmesh_main
from app.launcher import Stack, StackOptions
from services.router.access import AdminKey, Tenants
from services.router.errors import ErrorKind, RequestError
from services.router.loras import under_root

# ---- the admin key -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-admin"}, {"x-api-key": "anything"}])
def test_without_an_admin_key_configured_every_call_is_forbidden_alike(headers):
    with pytest.raises(RequestError) as e:
        AdminKey("").authorize(headers)
    assert e.value.kind == ErrorKind.FORBIDDEN and "admin_key" in e.value.message
    assert "sk-admin" not in e.value.message and "anything" not in e.value.message


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-admi"}, {"authorization": "Bearer sk-tenant"},
                                     {"x-api-key": "sk-admin2"}, {"authorization": "Basic sk-admin"}])
def test_a_call_without_the_admin_key_is_unauthenticated(headers):
    with pytest.raises(RequestError) as e:
        AdminKey("sk-admin").authorize(headers)
    assert e.value.kind == ErrorKind.UNAUTHENTICATED and "admin key" in e.value.message


@pytest.mark.parametrize("headers", [{"authorization": "Bearer sk-admin"}, {"x-api-key": "sk-admin"},
                                     {"authorization": "bearer  sk-admin "}])
def test_the_admin_key_passes_as_bearer_or_x_api_key(headers):
    AdminKey("sk-admin").authorize(headers)


@pytest.mark.parametrize("cfg,words", [
    ({"admin_key": "sk-a", "api_keys": {"sk-a": "alice"}}, "also a tenant key"),
    ({"admin_key": "sk-a", "api_key": "sk-a"}, "also a tenant key"),
    ({"admin_key": "sk a"}, "without spaces"),
    ({"lora_root": "adapters"}, "absolute path"),
])
def test_bad_admin_settings_are_refused_naming_them(cfg, words):
    with pytest.raises(ValueError, match="invalid router settings") as e:
        RouterSettings(**cfg)
    assert words in str(e.value)


def test_an_admin_key_in_the_tenant_keys_file_stops_the_router(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a:alice\n")
    with pytest.raises(ValueError, match="admin_key is also a tenant key"):
        Tenants.from_config(RouterSettings(admin_key="sk-a", api_keys_file=str(path)))


# ---- the root --------------------------------------------------------------------------------------------------

def test_paths_under_the_root_are_taken_absolute_or_relative(tmp_path):
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    assert under_root(str(root / "sql"), str(root)) == str(root / "sql")
    assert under_root("sql", str(root)) == str(root / "sql")
    assert under_root("team/./new/../sql", str(root)) == str(root / "team" / "sql")  # need not exist yet


def test_paths_that_leave_the_root_are_refused(tmp_path):
    root, outside = tmp_path / "adapters", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    for path in ("/etc", str(outside), "../elsewhere", f"{root}/../elsewhere", "link", str(root / "link" / "x"),
                 str(tmp_path / "adapters-evil")):
        with pytest.raises(RequestError) as e:
            under_root(path, str(root))
        assert e.value.kind == ErrorKind.INVALID and "outside lora_root" in e.value.message, path


def test_without_a_root_every_runtime_load_is_forbidden(tmp_path):
    with pytest.raises(RequestError) as e:
        under_root(str(tmp_path), "")
    assert e.value.kind == ErrorKind.FORBIDDEN and "lora_root" in e.value.message


# ---- kvmesh up and config show -----------------------------------------------------------------------------------

def test_kvmesh_up_hands_the_router_its_admin_key_and_root(tmp_path, monkeypatch, capsys):
    for k in [k for k in os.environ if k.startswith("KVMESH_")]:
        monkeypatch.delenv(k)
    with pytest.raises(SystemExit):
        kvmesh_main(["up", "--help"])
    out = capsys.readouterr().out
    assert "--router-admin-key" in out and "--router-lora-root" in out
    opts = StackOptions.local("t", settings={"router": {"admin_key": "sk-admin", "lora_root": "/srv/adapters"}})
    env = Stack(tmp_path, opts).child_env
    assert env["KVMESH_ROUTER_ADMIN_KEY"] == "sk-admin" and env["KVMESH_ROUTER_LORA_ROOT"] == "/srv/adapters"


def test_config_show_masks_the_admin_key(monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_ROUTER_ADMIN_KEY", "sk-admin-secret")
    monkeypatch.setenv("KVMESH_ROUTER_LORA_ROOT", "/srv/adapters")
    assert kvmesh_main(["config", "show", "--service", "router", "--json"]) == 0
    out = capsys.readouterr().out
    assert "sk-admin-secret" not in out
    shown = json.loads(out)["router"]
    assert shown["admin_key"] == {"value": "***", "source": "env", "env": "KVMESH_ROUTER_ADMIN_KEY"}
    assert shown["lora_root"]["value"] == "/srv/adapters"
