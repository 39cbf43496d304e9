"""Safe by default: ``pd-router`` refuses to serve its admin API without a key on an address
other hosts can reach unless told ``--allow-unauthenticated``; the key comes from
``$PD_ROUTER_ADMIN_KEY`` or a file, never only from the command line; start-up says what is
open."""

from __future__ import annotations

import httpx

from tests.cli_process import NOWHERE, PD_ROUTER, one_line_error, run, serving

KEY = "exposure-test-key"


def test_a_non_loopback_bind_without_an_admin_key_is_refused_saying_how_to_proceed(free_port):
    line = one_line_error(run(PD_ROUTER, *NOWHERE, "--host", "0.0.0.0", "--port", str(free_port())))
    assert "0.0.0.0" in line
    for remedy in ("PD_ROUTER_ADMIN_KEY", "--admin-api-key-file", "--allow-unauthenticated"):
        assert remedy in line


def test_the_default_address_is_refused_without_an_admin_key_as_well(free_port):
    line = one_line_error(run(PD_ROUTER, *NOWHERE, "--port", str(free_port())))
    assert "--allow-unauthenticated" in line


def test_allow_unauthenticated_serves_every_interface_and_says_the_admin_api_is_open():
    with serving(*NOWHERE, "--host", "0.0.0.0", "--allow-unauthenticated") as router:
        assert httpx.get(router.url + "/workers").status_code == 200
        assert "admin API is OPEN" in router.log()


def test_a_loopback_router_without_a_key_serves_and_says_only_this_host_can_reach_it():
    with serving(*NOWHERE, "--host", "127.0.0.1") as router:
        assert httpx.get(router.url + "/workers").status_code == 200
        assert "admin API is OPEN to this host only" in router.log()


def test_the_admin_key_from_the_environment_guards_the_admin_api():
    env = {"PD_ROUTER_ADMIN_KEY": KEY}
    with serving(*NOWHERE, "--host", "0.0.0.0", env=env) as router:
        assert httpx.get(router.url + "/workers").status_code == 401
        authorized = httpx.get(router.url + "/workers", headers={"Authorization": f"Bearer {KEY}"})
        assert authorized.status_code == 200
        log = router.log()
        assert "admin API requires the key (from $PD_ROUTER_ADMIN_KEY)" in log
        assert KEY not in log


def test_the_admin_key_from_a_file_guards_the_admin_api(tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY + "\n")
    with serving(*NOWHERE, "--host", "127.0.0.1", "--admin-api-key-file", str(key_file)) as router:
        assert httpx.get(router.url + "/workers").status_code == 401
        authorized = httpx.get(router.url + "/workers", headers={"Authorization": f"Bearer {KEY}"})
        assert authorized.status_code == 200
        assert f"admin API requires the key (from {key_file})" in router.log()


def test_the_config_file_names_the_admin_key_file(tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY)
    config = tmp_path / "router.toml"
    config.write_text(f'host = "0.0.0.0"\nadmin_api_key_file = "{key_file}"\n')
    with serving(*NOWHERE, "--config", str(config)) as router:
        assert httpx.get(router.url + "/workers").status_code == 401
