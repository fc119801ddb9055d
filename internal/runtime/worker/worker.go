// Package worker is the host worker: the one process that owns a root's
// sandboxes and their mounts and serves the API of package api on
// <root>/dsec.sock. Clients (the CLI, the SDK) come and go; sandboxes do
// not depend on them, nor on the worker: each sandbox's init and each
// lazy layer's fetcher is its own process, so a worker that dies (kill
// -9 included) leaves every sandbox running, and the next worker on the
// root re-adopts them (Serve's first step), collecting the results of
// the commands that ran meanwhile.
//
// One worker per root: <root>/worker.lock is held while it runs and
// <root>/worker.pid names it.
package worker

import (
	"log/slog"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/layer/image"
	"github.com/dsec-project/dsec/internal/layer/lazy"
	"github.com/dsec-project/dsec/internal/layer/remote"
	"github.com/dsec-project/dsec/internal/runtime/driver/vms"
	"github.com/dsec-project/dsec/internal/runtime/microvm"
	"github.com/dsec-project/dsec/internal/snap"
)

// Config configures a worker.
type Config struct {
	Root string
	// AdminTokenFile holds an admin token the TCP API takes besides the
	// root's tokens (auth.Store.PinAdmin).
	AdminTokenFile string
	Version        string // reported by GET /v1/version
	Remote         remote.Target
	Insecure       bool
	// Registries says how images a create names are pulled on first
	// use (platform, insecure registries; credentials as docker login
	// left them, or DSEC_REGISTRY_*).
	Registries image.Options
	Fetcher    lazy.Start  // how to start a lazy layer's fetcher
	Cache      lazy.Tuning // cache.max_bytes, cache.read_ahead_kb
	// SnapLimits bound pack-diff where a request does not (snap.max_*).
	SnapLimits snap.Limits
	// PublishSnapshots pushes each snapshot packed here to Remote before
	// the pack is answered (snap.publish): a fleet's workers sharing the
	// remote branch one another's snapshots lazily.
	PublishSnapshots bool
	Log              *slog.Logger
	// ExitIdle, if set, stops the worker once no sandbox exists and no
	// request came for that long (a worker the CLI started on demand).
	ExitIdle time.Duration
	// Ready, if set, is called once the socket accepts requests.
	Ready func()
	// Admission bounds what runs and how much is made at once.
	Admission Admission
	// Reclaim takes back idle sandboxes' memory.
	Reclaim Reclaim
	// Pools are the FnCall backend's warm pools, kept from the start.
	Pools []PoolConfig
	// KeepLayers keeps a layer mounted this long after its last
	// sandbox lets go of it (0: unmounted at once).
	KeepLayers time.Duration
	// Defaults bound a sandbox that asks for no limit of its own.
	Defaults Defaults
	// MaxOutput caps what an exec's journal keeps of its output, stdout
	// and stderr together (exec.max_output; 0: 64 MiB), lowered to the
	// sandbox's disk bound.
	MaxOutput int64
	// Listen are TCP addresses (tcp://HOST:PORT) the worker serves its
	// API on too, every request with a token (package auth); TLS is
	// their certificate, which an address off loopback needs.
	Listen []string
	TLS    TLS
	// MaxRequests bounds the requests served at once over TCP and from
	// the E2B front together (default 4096), MaxRequestsPerToken those
	// of one token or key (default 1024).
	MaxRequests, MaxRequestsPerToken int
	// E2B serves E2B's API too (package e2b).
	E2B E2B
	// CgroupParent names the group all sandboxes live under (default
	// dsec; tests give their own, so that their bounds bound nothing
	// else).
	CgroupParent string
	// MicroVM configures the microvm backend, VM the vm backend.
	MicroVM microvm.Settings
	VM      vms.Settings
	// Drivers are backends beyond the built-in ones (a test's: a
	// program that serves a worker registers them in Go).
	Drivers []Driver `json:"-"`
	// DNS configures the resolvers of sandboxes with domain rules.
	DNS egress.Config
}

// E2B configures the E2B front: the address it listens on (HOST:PORT;
// none: no front), the templates the config names (e2b.templates), and
// the domain its answers give the sandboxes (none: the SDK routes by
// headers to E2B_SANDBOX_URL).
type E2B struct {
	Listen    string
	Templates map[string]api.SandboxSpec
	Domain    string
	ImageKeys []string // e2b.Options.ImageKeys
	// HTTP2 offers HTTP/2 beside HTTP/1.1 over TLS. Off by default:
	// the JS SDK's HTTP/2 path costs each request ~5% over HTTP/1.1
	// (BENCHMARKS.md); on, its requests share a few connections.
	HTTP2 bool
}

// TLS is where a TCP listener's certificate and key are, and the CA
// whose certificates clients must show (none: no client certificate).
type TLS struct {
	Cert, Key, ClientCA string
}

// Defaults are the limits of a sandbox that asks for none (memory,
// pids, disk): every path that makes one (run, branch, restore, pools)
// gets them; api.Unlimited opts out. They are limits, not requests:
// admission counts only what a sandbox asks for.
type Defaults struct {
	Memory int64 // default 2 GiB, or the sandbox's memory request if more
	Pids   int64 // default 4096
	// Disk bounds what a sandbox without a disk quota of its own
	// writes, on the root's uppers file system (default 10 GiB;
	// api.Unlimited: only that file system's size).
	Disk int64
}

func (d Defaults) withDefaults() Defaults {
	if d.Memory == 0 {
		d.Memory = 2 << 30
	}
	if d.Pids == 0 {
		d.Pids = 4096
	}
	if d.Disk == 0 {
		d.Disk = 10 << 30
	}
	return d
}

// limit is the limit a sandbox gets for what it asked (0: the
// default, at least its request; api.Unlimited: none).
func limit(asked, request, def int64) int64 {
	switch {
	case asked == api.Unlimited:
		return 0
	case asked > 0:
		return asked
	case def < 0: // the default itself is none
		return 0
	}
	return max(def, request)
}

// Reclaim says when the worker takes back an idle sandbox's memory.
type Reclaim struct {
	// IdleAfter: a running sandbox in which no exec started or ended
	// for this long has its page cache reclaimed, once per idle spell
	// (default 10 minutes; negative: never).
	IdleAfter time.Duration
	// KSM marks every sandbox's anonymous memory mergeable by KSM (the
	// host must run ksmd: /sys/kernel/mm/ksm/run).
	KSM bool
	// Pressure: at this memory pressure (PSI some avg10, percent: the
	// host's or all sandboxes' together) batch sandboxes' memory is
	// reclaimed, then they are frozen until it passes (default 20;
	// negative: never).
	Pressure float64
	// HintMin: an idle hint freezes a sandbox expected to wait at
	// least this long (default 2 s; negative: hints are ignored).
	HintMin time.Duration
}

func (r Reclaim) withDefaults() Reclaim {
	if r.Pressure == 0 {
		r.Pressure = 20
	}
	if r.HintMin == 0 {
		r.HintMin = 2 * time.Second
	}
	return r
}

// PoolConfig is a FnCall pool: Size warm sandboxes made from Spec.
type PoolConfig struct {
	Name string          `json:"name"`
	Size int             `json:"size"`
	Spec api.SandboxSpec `json:"spec"`
}
