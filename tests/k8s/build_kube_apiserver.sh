#!/bin/sh
# Builds a static kube-apiserver for the Kubernetes discovery tests, once: the tests run it on a
# real etcd instead of a mock. Source: Debian bookworm's `kubernetes` source package (upstream
# v1.20.2 with vendor/), compiled with Debian's Go 1.19 unpacked from its .deb (nothing of Go
# is installed). The vendored github.com/modern-go/reflect2 v1.0.1 does not work on Go >= 1.18;
# Debian's v1.0.2 replaces it. About 6 minutes and 1.3 GB of memory on 2 cores; the 110 MB
# binary is kept at $PD_ROUTER_CACHE/kube-apiserver (default ~/.cache/pd-router) and a later
# call returns at once. Prints the binary's path; exits non-zero when it cannot be built.
set -eu

CACHE="${PD_ROUTER_CACHE:-$HOME/.cache/pd-router}"
BIN="$CACHE/kube-apiserver"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

command -v apt-get >/dev/null 2>&1 || { echo "kube-apiserver: needs apt-get (Debian)" >&2; exit 1; }
if ! command -v rsync >/dev/null 2>&1; then
	[ "$(id -u)" = 0 ] || { echo "kube-apiserver: rsync missing and not root" >&2; exit 1; }
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rsync >/dev/null
fi

mkdir -p "$CACHE"
WORK="$(mktemp -d "$CACHE/kube-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

# A private apt configuration with the source index, so the system's sources stay as they are.
mkdir -p apt/lists/partial apt/cache/archives/partial
echo "deb-src http://deb.debian.org/debian bookworm main" >sources.list
set -- -o Dir::Etc::SourceList="$WORK/sources.list" -o Dir::Etc::SourceParts=/dev/null \
	-o Dir::State::Lists="$WORK/apt/lists" -o Dir::Cache="$WORK/apt/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root
apt-get "$@" update -qq
apt-get "$@" source --download-only -qq kubernetes/bookworm
apt-get -o APT::Sandbox::User=root download -qq golang-1.19-go golang-1.19-src golang-github-modern-go-reflect2-dev

for deb in golang-1.19-go_*.deb golang-1.19-src_*.deb golang-github-modern-go-reflect2-dev_*.deb; do
	dpkg -x "$deb" root
done
mkdir src
tar -xf kubernetes_*.orig.tar.* -C src --strip-components=1
REFLECT2="$WORK/src/vendor/github.com/modern-go/reflect2"
rm -rf "$REFLECT2"
cp -r root/usr/share/gocode/src/github.com/modern-go/reflect2 "$REFLECT2"
rm -rf "$REFLECT2/test" "$REFLECT2/test15" "$REFLECT2/tests"

cat >version <<'V'
KUBE_GIT_COMMIT=''
KUBE_GIT_TREE_STATE='archive'
KUBE_GIT_VERSION='v1.20.2'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
V
export GOROOT="$WORK/root/usr/lib/go-1.19" GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache"
export GOFLAGS=-mod=vendor GO111MODULE=on GOTOOLCHAIN=local CGO_ENABLED=0
export PATH="$GOROOT/bin:$PATH"
(cd src && make WHAT=cmd/kube-apiserver KUBE_GIT_VERSION_FILE="$WORK/version" >"$WORK/build.log" 2>&1) || {
	tail -30 "$WORK/build.log" >&2
	exit 1
}
cp src/_output/local/bin/linux/*/kube-apiserver "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
echo "$BIN"
