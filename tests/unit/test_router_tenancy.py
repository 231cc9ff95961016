"""What keeps tenants apart at the router beyond their keys: the id each request carries inside the mesh (never
another tenant's, whatever id its client chose), and the per-tenant quotas and SLO classes."""

from __future__ import annotations

import pytest
from kvmesh import settings
from kvmesh.contracts.slo import NO_SLO, SLO
from kvmesh.settings import RouterSettings

from services.router import openai_body
from services.router.access import Admission, TenantTerms, dispatch_id
from services.router.errors import ErrorKind, RequestError


def test_two_tenants_giving_the_same_request_id_get_different_dispatch_ids():
    a, b = dispatch_id("alice", "req-1"), dispatch_id("bob", "req-1")
    assert a != b and a.split(".")[0] != b.split(".")[0]  # the tenant's part differs, not only the nonce


def test_one_tenant_reusing_its_own_request_id_gets_a_fresh_dispatch_id_each_time():
    assert dispatch_id("alice", "req-1") != dispatch_id("alice", "req-1")


def test_a_dispatch_id_keeps_the_clients_id_whole_for_logs():
    tag, rest = dispatch_id("", "client.id.with.dots").split(".", 1)
    assert len(tag) == 8 and rest.rsplit(".", 1)[0] == "client.id.with.dots"


# ---- quotas ------------------------------------------------------------------------------------------------------

def test_by_default_a_tenant_has_64_slots_and_an_hour_of_retention_at_priority_90_at_most():
    cfg = RouterSettings()
    assert (cfg.max_requests_per_tenant, cfg.max_retention_s_per_tenant, cfg.max_priority_per_tenant) == (64, 3600, 90)
    gate = Admission.from_config(cfg)
    for _ in range(64):
        gate.enter("alice")
    with pytest.raises(RequestError, match="tenant alice is at its quota of 64 .*max_requests_per_tenant") as e:
        gate.enter("alice")
    assert e.value.kind == ErrorKind.OVERLOADED  # 429 / RESOURCE_EXHAUSTED with a retry hint
    gate.enter("bob")  # another tenant still gets in


def test_n_choices_take_n_slots_and_give_them_all_back():
    gate = Admission(max_total=10, max_per_tenant=4)
    first = gate.enter("alice", 3)  # n=3: three requests at the engines
    with pytest.raises(RequestError, match=r"quota of 4 .*\(n=2 counts as 2 requests\)"):
        gate.enter("alice", 2)
    assert gate.per_tenant == {"alice": 3} and gate.total == 3  # a refusal takes nothing
    gate.enter("alice")
    with pytest.raises(RequestError, match=r"limit of 10 requests in flight \(n=8 counts as 8"):
        gate.enter("bob", 8)
    first()
    first()  # idempotent
    assert gate.per_tenant == {"alice": 1} and gate.total == 1
    assert openai_body.draft({"prompt": "x", "n": 3}, False, {}).choices == 3
    assert openai_body.draft({"prompt": "x"}, False, {}).choices == 1


def test_the_tenant_less_caller_has_the_global_cap_alone():
    gate = Admission(max_total=100, max_per_tenant=2)
    for _ in range(3):
        gate.enter("")
    assert gate.total == 3


@pytest.mark.parametrize("ttl_s,priority,words", [(7 * 24 * 3600.0, 50, "retention cap of 3600 s"),
                                                  (60.0, 100, r"cap of 90 \(max_priority_per_tenant\)")])
def test_a_retention_hint_over_the_tenant_caps_is_refused_naming_the_cap(ttl_s, priority, words):
    terms = TenantTerms.from_config(RouterSettings())
    with pytest.raises(RequestError, match=words) as e:
        terms.check_retention(ttl_s, priority, "cache_control")
    assert e.value.kind == ErrorKind.INVALID and "cache_control" in e.value.message


# ---- SLO classes -----------------------------------------------------------------------------------------------

def test_a_request_without_targets_gets_its_tenants_class():
    terms = TenantTerms.from_config(RouterSettings(tenant_classes={"alice": "interactive"}))
    assert terms.slo("alice", NO_SLO) == SLO(6.0, 0.15)
    assert terms.slo("bob", NO_SLO) == NO_SLO  # the default class, standard: no targets


def test_a_requests_own_targets_win_each_one_it_names():
    terms = TenantTerms.from_config(RouterSettings(tenant_classes={"alice": "interactive"}))
    assert terms.slo("alice", SLO(ttft_s=1.0)) == SLO(1.0, 0.15)


def test_classes_come_from_the_environment_as_pairs():
    cfg = settings.load(["router"], env={"KVMESH_ROUTER_SLO_CLASSES": "gold:0.5/0.05,bulk:0/0",
                                         "KVMESH_ROUTER_TENANT_CLASSES": "alice:gold",
                                         "KVMESH_ROUTER_DEFAULT_SLO_CLASS": "bulk"}).router
    assert TenantTerms.from_config(cfg).slo("alice", NO_SLO) == SLO(0.5, 0.05)


@pytest.mark.parametrize("fields,words", [
    ({"slo_classes": {"x": "fast"}}, "class 'x' must be TTFT/ITL seconds"),
    ({"tenant_classes": {"alice": "gold"}}, "names class 'gold', not one of slo_classes"),
    ({"default_slo_class": "gold"}, "default_slo_class 'gold' is not one of slo_classes"),
    ({"max_priority_per_tenant": 101}, "max_priority_per_tenant must be in [0, 100]"),
])
def test_bad_class_settings_are_refused_naming_them(fields, words):
    with pytest.raises(ValueError, match="invalid router settings") as e:
        RouterSettings(**fields)
    assert words in str(e.value)
