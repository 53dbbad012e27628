#!/usr/bin/env bash
# Build (once) and cache the binaries of a real Kubernetes control plane for tests:
# kube-apiserver, kube-controller-manager, kube-scheduler (from k8s.io/kubernetes through a
# wrapper module that replaces each staging module with its published v0.x version), etcd
# (go.etcd.io/etcd/server/v3) and kwok (sigs.k8s.io/kwok). Everything comes from the Go
# module proxy; nothing is written inside the repository.
#
#   tests/executor/controlplane/build.sh   # prints the bin directory on its last line
#
# Cold, on a 2-core machine shared with other work: ~14 min (docs/executor.md); cached: instant.
#
# The cache is keyed by every version that goes into the binaries, so bumping one rebuilds.
set -euo pipefail

K8S_VERSION="${GPUSCHED_K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${GPUSCHED_ETCD_VERSION:-v3.7.3}"
KWOK_VERSION="${GPUSCHED_KWOK_VERSION:-v0.8.0}"
GO_VERSION="$(go env GOVERSION)"
STAGING_VERSION="v0.${K8S_VERSION#v1.}"          # v1.37.2 -> v0.37.2

CACHE_ROOT="${GPUSCHED_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpusched}"
KEY="k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}-kwok-${KWOK_VERSION}-${GO_VERSION}"
DEST="$CACHE_ROOT/$KEY"
BIN="$DEST/bin"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)
STAGES="$DEST/stages"

have_all() {
  for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || return 1; done
  [ -f "$STAGES/node-initialize.yaml" ] && [ -f "$STAGES/node-heartbeat.yaml" ]
}
if have_all; then echo "$BIN"; exit 0; fi

mkdir -p "$BIN" "$DEST/src"
export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local
NICE=(nice -n "${GPUSCHED_BUILD_NICE:-10}")
start=$(date +%s)
log() { echo "[build-k8s +$(( $(date +%s) - start ))s] $*" >&2; }

# --- kube-apiserver, kube-controller-manager, kube-scheduler ------------------------------
if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/kube-controller-manager" ] || [ ! -x "$BIN/kube-scheduler" ]; then
  W="$DEST/src/kubernetes"; mkdir -p "$W"; cd "$W"
  modfile="$(mktemp)"
  curl -fsS "$(go env GOPROXY | cut -d, -f1)/k8s.io/kubernetes/@v/${K8S_VERSION}.mod" -o "$modfile" \
    || go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" >/dev/null
  {
    echo "module gpusched.local/k8s-testenv"
    echo
    echo "go $(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1/')"
    echo
    echo "require k8s.io/kubernetes ${K8S_VERSION}"
    echo
    echo "replace ("
    # Every staging module k8s.io/kubernetes replaces with ./staging/src/... is required as
    # v0.0.0; point each at the published tag instead (the scheduler-plugins pattern).
    grep -E '=> \./staging/src/' "$modfile" | awk -v v="$STAGING_VERSION" '{print "\t" $1 " => " $1 " " v}' \
      | grep -v -E 'k8s.io/sample-(cli-plugin|controller) '
    echo ")"
  } > go.mod
  rm -f "$modfile"
  log "resolving k8s.io/kubernetes ${K8S_VERSION} (staging ${STAGING_VERSION})"
  pkgs=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler)
  go get "${pkgs[@]/%/@${K8S_VERSION}}" >&2
  major="${K8S_VERSION#v}"; major="${major%%.*}"; minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
  ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=${K8S_VERSION} -X $p.gitMajor=${major} -X $p.gitMinor=${minor}"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  log "building kube-apiserver, kube-controller-manager, kube-scheduler"
  "${NICE[@]}" go build -trimpath -ldflags "$ldflags" -o "$BIN/" "${pkgs[@]}"
  log "built kubernetes binaries"
fi

# --- etcd (its go.mod has relative replaces, so build it through a wrapper module too) -----
if [ ! -x "$BIN/etcd" ]; then
  W="$DEST/src/etcd"; mkdir -p "$W"; cd "$W"
  printf 'module gpusched.local/etcd-testenv\n\ngo %s\n\nrequire go.etcd.io/etcd/server/v3 %s\n' \
    "$(go env GOVERSION | sed 's/^go//; s/^\([0-9]*\.[0-9]*\).*/\1/')" "$ETCD_VERSION" > go.mod
  log "building etcd ${ETCD_VERSION}"
  go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2
  "${NICE[@]}" go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  log "built etcd"
fi

# --- kwok ----------------------------------------------------------------------------------
if [ ! -x "$BIN/kwok" ]; then
  log "building kwok ${KWOK_VERSION}"
  GOBIN="$BIN" GOFLAGS="-buildvcs=false" "${NICE[@]}" go install -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION}" \
    "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
  log "built kwok"
fi

# kwok's own node Stages (initialize: Ready with the capacity the Node was created with;
# heartbeat: keep it Ready), kept beside the binaries for the tests.
mkdir -p "$STAGES"
KWOK_SRC="$(GOFLAGS= go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
cp "$KWOK_SRC/kustomize/stage/node/fast/node-initialize.yaml" "$STAGES/node-initialize.yaml"
cp "$KWOK_SRC/kustomize/stage/node/heartbeat/node-heartbeat.yaml" "$STAGES/node-heartbeat.yaml"

have_all
[ -f "$DEST/build-seconds" ] || echo "$(( $(date +%s) - start ))" > "$DEST/build-seconds"
log "done (the cold build took $(cat "$DEST/build-seconds")s)"
echo "$BIN"
