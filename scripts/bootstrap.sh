#!/usr/bin/env bash
# Installs what meshopt needs on a Debian machine: system packages and a virtualenv.
# Idempotent: packages already present are skipped; the venv is reinstalled only when
# pyproject.toml changed since the last run.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$here/.venv"

# Debian packages: Python, and the tools the lab uses (namespaces, WireGuard, broker, probes).
pkgs=(python3 python3-venv python3-dev gcc iproute2 iputils-ping iperf3
      wireguard-go wireguard-tools mosquitto mosquitto-clients tcpdump prometheus)
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    missing=()
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "bootstrap: installing ${missing[*]}" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        # Debian enables the broker on install; the lab starts its own instances.
        for svc in mosquitto prometheus; do
            if printf '%s\n' "${missing[@]}" | grep -qx "$svc" && command -v systemctl >/dev/null; then
                systemctl disable --now "$svc" >/dev/null 2>&1 || true
            fi
        done
    fi
else
    echo "bootstrap: not root or no apt-get; skipping system packages" >&2
fi

# A Python >= 3.11: the first on PATH that qualifies, else Debian's.
py=""
for cand in python3 python3.13 python3.12 python3.11 /usr/bin/python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        py=$(command -v "$cand"); break
    fi
done
[ -n "$py" ] || { echo "bootstrap: need Python >= 3.11 with venv" >&2; exit 1; }

stamp="$venv/.meshopt-installed"
want=$(sha256sum "$here/pyproject.toml" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "bootstrap: installing meshopt into $venv" >&2
    log="$venv/pip.log"
    # The distribution was called "meshopt" before it became meshopt-wg: a venv made
    # then has both claiming bin/meshopt; the old one goes first.
    if "$venv/bin/python" -m pip show -q meshopt >/dev/null 2>&1; then
        "$venv/bin/python" -m pip uninstall -q -y meshopt >/dev/null 2>&1 || true
        rm -rf "$here/meshopt.egg-info"
    fi
    # Every extra: the tests cover the controller, drawing, transfers and the lab.
    if ! { "$venv/bin/python" -m pip install -q --upgrade pip &&
           "$venv/bin/python" -m pip install -q -e "$here[dev,controller,graph,transfer,lab]"
         } >"$log" 2>&1; then
        cat "$log" >&2
        echo "bootstrap: pip install failed (log above, also in $log)" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
