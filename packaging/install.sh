#!/usr/bin/env bash
# meshopt's operator install on Debian (12+) or Ubuntu: a venv under /opt/meshopt, a
# system user, /etc/meshopt, the systemd units and the iproute2 names. Idempotent: run it
# again to upgrade (pip installs the newer wheel; units are rewritten only if changed).
#
#   packaging/install.sh [--controller] [--transfer] [--from WHEEL_OR_DIR]
#                        [--prefix /opt/meshopt] [--root DIR] [--no-apt] [--dry-run]
#
#   --controller   also the controller (extra [controller]: numpy, scipy, networkx) and
#                  its unit; nodes that only run the agent leave it out
#   --transfer     the bulk-transfer receiver's libraries (extra [transfer])
#   --from X       a wheel (meshopt_wg-*.whl), a source directory, or a pip requirement
#                  (default: this checkout if the script is in one, else meshopt-wg from
#                  the package index)
#   --prefix P     the venv (default /opt/meshopt); the units are rewritten to use it
#   --root DIR     write the system files (etc/, var/) under DIR instead of /, and skip
#                  apt, the user and systemctl: for staging an image, and for tests
#   --no-apt       do not install Debian packages (they are still checked and named)
#   --dry-run      print every action, change nothing
#
# See docs/install.md. Exit status: 0 done, 2 bad arguments or an unsuitable host.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
prefix=/opt/meshopt
root=""
from=""
controller=0
transfer=0
dry=0
apt=1
user=meshopt

die() { echo "install.sh: $*" >&2; exit 2; }
say() { echo "install.sh: $*" >&2; }
# run: print the command, then run it unless --dry-run.
run() {
    printf '+' >&2; printf ' %q' "$@" >&2; printf '\n' >&2
    [ "$dry" = 1 ] || "$@"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --controller) controller=1 ;;
        --transfer) transfer=1 ;;
        --from) [ $# -ge 2 ] || die "--from needs a wheel, directory or requirement"; from=$2; shift ;;
        --from=*) from=${1#--from=} ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix=$2; shift ;;
        --prefix=*) prefix=${1#--prefix=} ;;
        --root) [ $# -ge 2 ] || die "--root needs a directory"; root=$2; shift ;;
        --root=*) root=${1#--root=} ;;
        --no-apt) apt=0 ;;
        --dry-run|-n) dry=1 ;;
        -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

case "$prefix" in /*) ;; *) die "--prefix must be an absolute path, got '$prefix'" ;; esac
prefix=${prefix%/}
[ -n "$prefix" ] || die "--prefix must not be /"
[[ "$prefix" =~ ^[A-Za-z0-9/._-]+$ ]] || die "--prefix '$prefix': only letters, digits and / . _ -"
if [ -n "$root" ]; then
    case "$root" in /*) ;; *) die "--root must be an absolute path, got '$root'" ;; esac
    root=${root%/}
    apt=0
fi
system=1                        # the user, chown and systemctl: only on the real host
[ -z "$root" ] || system=0
if [ "$dry" = 0 ] && [ "$system" = 1 ] && [ "$(id -u)" != 0 ]; then
    die "run as root (or use --dry-run to see what it would do, --root DIR to stage)"
fi

# What to install: a wheel, a source tree, or the published distribution.
if [ -z "$from" ]; then
    if [ -f "$repo/pyproject.toml" ] && grep -q '^name = "meshopt-wg"' "$repo/pyproject.toml"; then
        from=$repo
    else
        from=meshopt-wg
    fi
fi
if [ -e "$from" ]; then
    from=$(cd "$(dirname "$from")" && pwd)/$(basename "$from")
    if [ -d "$from" ]; then
        [ -f "$from/pyproject.toml" ] || die "--from $from: no pyproject.toml there"
    else
        case "$from" in *.whl) ;; *) die "--from $from: not a wheel (.whl) or a directory" ;; esac
    fi
fi
extras=()
[ "$controller" = 0 ] || extras+=(controller)
[ "$transfer" = 0 ] || extras+=(transfer)
spec=$from
if [ ${#extras[@]} -gt 0 ]; then
    spec="$from[$(IFS=,; echo "${extras[*]}")]"
fi

# 1. Debian packages needed at run time. wireguard-go only where the kernel has no
#    WireGuard (built in, loaded, or as a module for this kernel).
kernel_wg=0
if [ -d /sys/module/wireguard ] ||
   compgen -G "/lib/modules/$(uname -r)/kernel/drivers/net/wireguard/wireguard.ko*" >/dev/null; then
    kernel_wg=1
fi
pkgs=(python3 python3-venv iproute2 wireguard-tools)
[ "$kernel_wg" = 1 ] || pkgs+=(wireguard-go)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            missing+=("$p")
    done
fi
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$apt" = 1 ]; then
        command -v apt-get >/dev/null 2>&1 || die "no apt-get: install ${missing[*]} yourself, then use --no-apt"
        run apt-get update -q
        run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    else
        say "not installing Debian packages; the host needs: ${missing[*]}"
    fi
fi

# 2. The venv and meshopt in it. pip upgrades what is there (same version: a no-op).
py=""
for cand in /usr/bin/python3 python3 python3.13 python3.12 python3.11; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        py=$(command -v "$cand"); break
    fi
done
if [ -z "$py" ]; then
    [ "$dry" = 1 ] || die "need Python >= 3.11 (Debian 12: apt-get install python3 python3-venv)"
    py=python3
fi
if [ ! -x "$prefix/bin/python" ]; then
    run "$py" -m venv "$prefix"
fi
run "$prefix/bin/python" -m pip install -q --disable-pip-version-check --upgrade "$spec"

# 3. The system user, configuration and state directories.
if [ "$system" = 1 ] && ! getent passwd "$user" >/dev/null; then
    run useradd --system --user-group --home-dir /var/lib/meshopt --no-create-home \
        --shell /usr/sbin/nologin --comment "meshopt daemons" "$user"
fi
owner=()
if [ "$system" = 1 ]; then owner=(-o root -g "$user"); fi
run install -d -m 0750 "${owner[@]}" "$root/etc/meshopt"
if [ "$system" = 1 ]; then owner=(-o "$user" -g "$user"); fi
run install -d -m 0750 "${owner[@]}" "$root/var/lib/meshopt"

# put SRC DST MODE [SED]: copy (through sed) when DST differs; never a half-written file.
changed=0
put() {
    local src=$1 dst=$2 mode=$3 expr=${4:-}
    local tmp
    tmp=$(mktemp)
    if [ -n "$expr" ]; then sed -E "$expr" "$src" >"$tmp"; else cat "$src" >"$tmp"; fi
    if [ -f "$dst" ] && cmp -s "$tmp" "$dst"; then
        say "unchanged: $dst"
    else
        printf '+ install -D -m %s %q %q%s\n' "$mode" "$src" "$dst" "${expr:+  # through sed $expr}" >&2
        [ "$dry" = 1 ] || install -D -m "$mode" "$tmp" "$dst"
        changed=1
    fi
    rm -f "$tmp"
}

# 4. The units, pointed at the prefix.
units=(meshopt-agent.service)
[ "$controller" = 0 ] || units+=(meshopt-controller.service)
subst=""
[ "$prefix" = /opt/meshopt ] || subst="s#/opt/meshopt(/|[[:space:]]|\$)#$prefix\\1#g"
for u in "${units[@]}"; do
    if [ -f "$here/systemd/$u" ]; then
        put "$here/systemd/$u" "$root/etc/systemd/system/$u" 0644 "$subst"
    else
        say "no $here/systemd/$u in this copy: unit not installed"
    fi
done

# 5. iproute2 names for meshopt's tables (7701, 7702) and route protocol (77).
for d in rt_tables.d rt_protos.d; do
    if [ -f "$here/iproute2/$d/meshopt.conf" ]; then
        put "$here/iproute2/$d/meshopt.conf" "$root/etc/iproute2/$d/meshopt.conf" 0644
    fi
done

# 6. Example configurations next to the real ones (never over them).
for f in agent.toml controller.toml; do
    [ "$f" = agent.toml ] || [ "$controller" = 1 ] || continue
    if [ -f "$repo/agents/$f" ]; then
        put "$repo/agents/$f" "$root/etc/meshopt/$f.example" 0640
    fi
done

# Key files already made as root (keygen writes 0600): readable by the daemons' group.
if [ "$system" = 1 ]; then
    for k in /etc/meshopt/*.key; do
        [ -f "$k" ] || continue
        if [ "$(stat -c '%U:%G %a' "$k")" = "root:root 600" ]; then
            run chgrp "$user" "$k"
            run chmod 0640 "$k"
        fi
    done
fi

if [ "$system" = 1 ] && [ "$changed" = 1 ] && [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
fi

# 7. What the operator does next.
cmd=$prefix/bin/meshopt
cat >&2 <<EOF

install.sh: meshopt is in $prefix ($cmd). Next steps:
  1. the node's signing key (it prints the public key to enrol at the controller);
     the daemons run as user $user, so the group reads it:
       $cmd agent keygen --out /etc/meshopt/agent.key
       chgrp $user /etc/meshopt/agent.key && chmod 0640 /etc/meshopt/agent.key
     (or run this script again: it does that for root's 0600 keys in /etc/meshopt)
  2. the configuration: start from /etc/meshopt/agent.toml.example (mesh, node,
     interfaces, controller_keys, [broker]), root:$user mode 0640; then check it:
       $cmd agent --config /etc/meshopt/agent.toml --check
  3. start it now and at boot:
       systemctl enable --now meshopt-agent
EOF
if [ "$controller" = 1 ]; then
    cat >&2 <<EOF
  controller: $cmd controller keygen --out /etc/meshopt/controller.key (chgrp and
     chmod it as above), /etc/meshopt/controller.toml (see controller.toml.example), then
       systemctl enable --now meshopt-controller
EOF
fi
echo "  (docs/install.md; docs/deploy.md for a whole mesh)" >&2
