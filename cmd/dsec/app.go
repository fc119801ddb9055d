package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"golang.org/x/term"

	"github.com/dsec-project/dsec/api"
	dlog "github.com/dsec-project/dsec/internal/log"
	"github.com/dsec-project/dsec/internal/units"
	"github.com/dsec-project/dsec/sdk"
)

// Config is every setting a config file, DSEC_* variables or global
// flags can give, resolved once in that order of precedence:
// flag > env > file > default. configDefaults holds the defaults the
// loader sets, and each field's doc tag is its line in
// docs/reference/config.md: gen-docs refuses a field without one.
type Config struct {
	Root      string              `mapstructure:"root" doc:"the directory holding all of dsec's state"`
	LogLevel  string              `mapstructure:"log-level" doc:"log level: debug, info, warn or error"`
	LogFormat string              `mapstructure:"log-format" doc:"log format on stderr: text or json"`
	Progress  string              `mapstructure:"progress" doc:"progress bars on stderr: auto (on a terminal), always or never"`
	Remote    string              `mapstructure:"remote" doc:"the default remote: a name of remotes, or a URL as remotes take"`
	Remotes   map[string]string   `mapstructure:"remotes" doc:"remotes by name: NAME: dir:///PATH or oci://HOST[:PORT]/REPOSITORY"`
	Cache     CacheConfig         `mapstructure:"cache" doc:"how this host mounts lazily fetched layers"`
	Admission AdmissionConfig     `mapstructure:"admission" doc:"what the worker admits, and makes at once and ahead of need"`
	Reclaim   ReclaimConfig       `mapstructure:"reclaim" doc:"when the worker takes back idle sandboxes' memory"`
	Pools     map[string]PoolFile `mapstructure:"pools" doc:"the FnCall backend's pools of warm sandboxes by name, kept from the worker's start (dsec pool)"`
	Defaults  DefaultsConfig      `mapstructure:"defaults" doc:"the limits of a sandbox that asks for none"`
	Exec      ExecConfig          `mapstructure:"exec" doc:"what the worker's journal keeps of a command"`
	// A worker's TCP API to talk to instead of the root's (tcp://HOST:PORT),
	// the token its requests carry, the CA its certificate is checked
	// against, and a client certificate for a worker that asks for one.
	Host       string `mapstructure:"host" doc:"a worker's TCP API to talk to instead of the root's: tcp://HOST:PORT"`
	Token      string `mapstructure:"token" doc:"the API token a client's requests carry (dsec token create makes one on the worker's host)"`
	TLSCA      string `mapstructure:"tls-ca" doc:"the CA file the host's certificate is checked against; TLS is used with one, with a client certificate, and off loopback"`
	ClientCert string `mapstructure:"client-cert" doc:"a client certificate file, for a worker that asks for one"`
	ClientKey  string `mapstructure:"client-key" doc:"the client certificate's key file"`
	// What dsec daemon serves on besides the root's socket (daemon.go).
	Listen []string `mapstructure:"listen" doc:"TCP addresses dsec daemon serves its API on besides the root's socket: tcp://HOST:PORT"`
	// AdminTokenFile holds an admin token the TCP API of dsec daemon or
	// dsec gateway takes besides the root's tokens, never written there
	// (a Kubernetes Secret's, shared by a fleet's workers and gateways).
	AdminTokenFile string          `mapstructure:"admin_token_file" doc:"a file holding an admin token the TCP API of dsec daemon or dsec gateway takes besides the root's tokens, never written there (a Kubernetes Secret's)"`
	TLS            ServerTLSConfig `mapstructure:"tls" doc:"the worker's TLS on its TCP addresses"`
	API            APIConfig       `mapstructure:"api" doc:"the requests the worker serves at once over TCP and from its E2B front"`
	E2B            E2BConfig       `mapstructure:"e2b" doc:"the E2B front dsec daemon serves"`
	// The microvm backend (microvm.Settings).
	MicroVM MicroVMConfig `mapstructure:"microvm" doc:"the microvm backend"`
	VM      VMConfig      `mapstructure:"vm" doc:"the vm backend (full VMs)"`
	// The resolvers of sandboxes with domain rules (egress.Config).
	DNS DNSConfig `mapstructure:"dns" doc:"the resolvers of sandboxes whose policies have domain rules"`
	// How images are pulled from registries.
	Registries RegistriesConfig `mapstructure:"registries" doc:"how images are pulled from registries (credentials as docker login left them, or DSEC_REGISTRY_USERNAME and DSEC_REGISTRY_PASSWORD)"`
	// What dsec gateway serves, and its workers.
	Gateway GatewayConfig `mapstructure:"gateway" doc:"what dsec gateway serves, and its workers"`
	// Snapshots (worker.Config.PublishSnapshots).
	Snap SnapConfig `mapstructure:"snap" doc:"what the worker does with the snapshots it packs"`
}

// SnapConfig is what a worker does with the snapshots it packs.
type SnapConfig struct {
	// Publish pushes each to the remote before the pack is answered.
	Publish bool `mapstructure:"publish" doc:"push each snapshot the worker packs to its remote before the pack is answered, so that a fleet's workers sharing that remote branch one another's snapshots"`
	// The bounds of a pack-diff that asks for none; a request may lower
	// them, only an admin's raise them.
	MaxBytes   int64 `mapstructure:"max_bytes" type:"size" doc:"the most file data a pack-diff packs (0: 64G); a request's --max-bytes may lower it, only an admin's raise it"`
	MaxEntries int   `mapstructure:"max_entries" doc:"the most paths a pack-diff packs (0: 2097152); a request may lower it, only an admin's raise it"`
	MaxDepth   int   `mapstructure:"max_depth" doc:"the deepest directory nesting a pack-diff packs (0: 256); a request may lower it, only an admin's raise it"`
}

// GatewayConfig is dsec gateway's: where it listens and its workers.
type GatewayConfig struct {
	Listen  []string        `mapstructure:"listen" doc:"TCP addresses dsec gateway serves on: tcp://HOST:PORT"`
	Workers []GatewayWorker `mapstructure:"workers" doc:"the workers of the gateway's fleet"`
	// Heartbeat is how often each worker is asked how it is (default
	// 2 s); a worker silent for three is down.
	Heartbeat time.Duration `mapstructure:"heartbeat" doc:"how often each worker is asked how it is (0: 2s); a worker silent for three is down"`
	// Kubernetes finds the workers in a cluster, besides Workers.
	Kubernetes GatewayKubernetes `mapstructure:"kubernetes" doc:"finding the workers in Kubernetes, besides workers: the endpoints of their Service"`
	// TokensFile is the clients' token store ("": ROOT/tokens.json),
	// read again when it changes: replicas of a gateway share one (a
	// Kubernetes Secret's).
	TokensFile string `mapstructure:"tokens_file" doc:"the clients' token store (none: ROOT/tokens.json), read again when it changes: a gateway's replicas share one"`
}

// GatewayKubernetes is where a gateway finds its workers in Kubernetes
// (kube.Config): the endpoints of their Service, each reached as Worker
// says (its URL aside).
type GatewayKubernetes struct {
	Service    string        `mapstructure:"service" doc:"the workers' Service: NAMESPACE/NAME, or NAME in the gateway's namespace"`
	Port       string        `mapstructure:"port" doc:"the name of the Service's port of the workers' API (none: api, or a Service's one port)"`
	Kubeconfig string        `mapstructure:"kubeconfig" doc:"a kubeconfig file (none: the pod's service account)"`
	Worker     GatewayWorker `mapstructure:"worker" doc:"how each worker is reached, as a workers entry says (its URL is the endpoint's)"`
}

// GatewayWorker is a worker of the gateway's fleet: its TCP API, an
// admin token of its, the CA its certificate is checked against, and
// the gateway's certificate for it.
type GatewayWorker struct {
	URL   string `mapstructure:"url" doc:"the worker's TCP API: tcp://HOST:PORT"`
	Token string `mapstructure:"token" doc:"an admin token of the worker's"`
	CA    string `mapstructure:"ca" doc:"the CA file its certificate is checked against"`
	// Cert and Key: the gateway's client certificate, for a worker that
	// asks for one.
	Cert string `mapstructure:"cert" doc:"the gateway's client certificate file, for a worker that asks for one"`
	Key  string `mapstructure:"key" doc:"that certificate's key file"`
	// TokenFile holds the token, for one not written in the config (a
	// Kubernetes Secret's).
	TokenFile string `mapstructure:"token_file" doc:"a file holding the token, for one not written in the config (a Kubernetes Secret's)"`
	// ServerName is the name its certificate must bear, for workers
	// reached by addresses their certificates do not name (a DaemonSet's
	// pods sharing one certificate).
	ServerName string `mapstructure:"server_name" doc:"the name its certificate must bear, for workers reached by addresses their certificates do not name"`
}

// RegistriesConfig says how images are pulled (image.Options).
type RegistriesConfig struct {
	// Insecure lists registries (HOST[:PORT]) spoken to over plain
	// HTTP; one on a loopback address always is.
	Insecure []string `mapstructure:"insecure" doc:"registries (HOST[:PORT]) spoken to over plain HTTP, beside those on loopback, which always are"`
	// Platform is the OS/ARCH[/VARIANT] taken from a multi-platform
	// image; "": the host's.
	Platform string `mapstructure:"platform" doc:"the OS/ARCH[/VARIANT] taken from a multi-platform image (none: this host's)"`
	// Mirrors are asked first for a registry's images (a list, as a
	// map's keys would be split at their dots).
	Mirrors []MirrorConfig `mapstructure:"mirrors" doc:"mirrors asked first for a registry's images"`
	// Compress stores imported layers' files compressed
	// (image.Options.Compress).
	Compress bool `mapstructure:"compress" doc:"store imported images' layer files LZ4-compressed where that saves a block (a store that packs layers keeps them uncompressed)"`
}

// MirrorConfig names the mirrors of a registry, asked in order.
type MirrorConfig struct {
	Registry string   `mapstructure:"registry" doc:"the registry: docker.io, ghcr.io or HOST:PORT"`
	Hosts    []string `mapstructure:"hosts" doc:"its mirrors, HOST[:PORT], asked in order"`
}

// APIConfig bounds the requests the worker serves at once over TCP and
// from its E2B front (worker.Config.MaxRequests, MaxRequestsPerToken).
type APIConfig struct {
	MaxRequests         int `mapstructure:"max_requests" doc:"requests served at once in all, past which they are answered busy (0: 4096)"`
	MaxRequestsPerToken int `mapstructure:"max_requests_per_token" doc:"requests of one token served at once, past which they are answered busy (0: 1024)"`
}

// DNSConfig configures the resolvers of sandboxes whose policies have
// domain rules: the servers they ask (default the host's, from
// /etc/resolv.conf), the least time a learned address stays allowed and
// the grace added to every answer's TTL.
type DNSConfig struct {
	Upstream []string      `mapstructure:"upstream" doc:"the servers they ask (none: the host's, from /etc/resolv.conf)"`
	MinTTL   time.Duration `mapstructure:"min_ttl" doc:"the least time a learned address stays allowed (0: 30s)"`
	Grace    time.Duration `mapstructure:"grace" doc:"the time added to every answer's TTL (0: 30s)"`
}

// MicroVMConfig configures the microvm backend: the guest kernel's
// directory (make kernel), the accelerator (auto, kvm, tcg), QEMU's
// binary, the guest's agent (a static dsec-init) and the bound on a
// guest's boot.
type MicroVMConfig struct {
	Kernel      string        `mapstructure:"kernel" doc:"the guest kernel's directory (none: bin/microvm beside dsecd, or PREFIX/lib/dsec/microvm, which make kernel and make install fill)"`
	Accel       string        `mapstructure:"accel" doc:"the accelerator: auto, kvm or tcg (none: auto)"`
	QEMU        string        `mapstructure:"qemu" doc:"QEMU's binary (none: qemu-system-x86_64 on PATH)"`
	Agent       string        `mapstructure:"agent" doc:"the guest's agent, a static dsec-init (none: the init the containers run)"`
	BootTimeout time.Duration `mapstructure:"boot_timeout" doc:"the bound on a guest's boot (0: 10s under KVM, 90s under TCG)"`
}

// VMConfig is the vm backend's configuration (vms.Settings).
type VMConfig struct {
	Accel       string        `mapstructure:"accel" doc:"the accelerator: auto, kvm or tcg (none: auto)"`
	QEMU        string        `mapstructure:"qemu" doc:"QEMU's binary (none: qemu-system-x86_64 on PATH)"`
	BootTimeout time.Duration `mapstructure:"boot_timeout" doc:"the bound on a VM's boot, firmware to its agent's answer (0: 60s under KVM, 300s under TCG)"`
	MaxChain    int           `mapstructure:"max_chain" doc:"the longest disk chain a snapshot leaves: a snapshot of one that long first flattens it, its diff the whole disk (0: 64, the most)"`
}

// E2BConfig is dsec daemon's E2B front (worker.E2B): the address it
// listens on, the domain its answers give, and its named templates.
type E2BConfig struct {
	Listen    string                 `mapstructure:"listen" doc:"the HOST:PORT the E2B front listens on (none: no front)"`
	Domain    string                 `mapstructure:"domain" doc:"the domain its answers give the sandboxes (none: the SDK routes by headers)"`
	Templates map[string]E2BTemplate `mapstructure:"templates" doc:"E2B template IDs by name, and the sandboxes made from each"`
	// ImageKeys are the create metadata keys that name a container
	// image, as trainers send one (default: image).
	ImageKeys []string `mapstructure:"image_metadata_keys" doc:"the create metadata keys that name a container image, as trainers send one (none: image)"`
	// HTTP2 offers HTTP/2 over TLS (worker.E2B.HTTP2).
	HTTP2 bool `mapstructure:"http2" doc:"offer HTTP/2 over TLS, which the E2B SDKs then multiplex over a few connections, at ~5% more per request than HTTP/1.1"`
}

// E2BTemplate is an E2B template ID the config names: layers (toolkit
// first), an image under them, and the defaults of the sandboxes made
// from it.
type E2BTemplate struct {
	Layers  []string `mapstructure:"layers" doc:"its layers, topmost (toolkit) first"`
	Image   string   `mapstructure:"image" doc:"a container image under the layers"`
	Pull    string   `mapstructure:"pull" doc:"when the image is fetched from its registry: missing (the default), never or always"`
	CPU     float64  `mapstructure:"cpu" doc:"CPUs (0: no limit)"`
	Memory  string   `mapstructure:"memory" type:"size" doc:"the memory limit (none: the worker's default)"`
	Disk    string   `mapstructure:"disk" type:"size" doc:"the bound on what a sandbox writes (none: the worker's default)"`
	Pids    int64    `mapstructure:"pids" doc:"the process limit (0: the worker's default)"`
	Policy  string   `mapstructure:"policy" doc:"a stored policy's name"`
	Backend string   `mapstructure:"backend" doc:"the backend: container (none), microvm or vm"`
	Class   string   `mapstructure:"class" doc:"the scheduling class: latency (none) or batch"`
	Env     []string `mapstructure:"env" doc:"environment variables, NAME=VALUE"`
	Workdir string   `mapstructure:"workdir" doc:"the commands' working directory"`
	UserNS  bool     `mapstructure:"userns" doc:"run each sandbox in a user namespace of its own"`
}

// ServerTLSConfig is the worker's TLS on its TCP addresses.
type ServerTLSConfig struct {
	Cert     string `mapstructure:"cert" doc:"the certificate file of the TCP addresses (an address off loopback needs one)"`
	Key      string `mapstructure:"key" doc:"the certificate's key file"`
	ClientCA string `mapstructure:"client_ca" doc:"a CA file: only clients with a certificate it signed are served"`
}

// DefaultsConfig bounds a sandbox that asks for no limit (worker.Defaults).
type DefaultsConfig struct {
	Memory string `mapstructure:"memory" type:"size" doc:"a sandbox's memory limit, or unlimited (none: 2G, or the sandbox's memory request if more)"`
	Pids   int64  `mapstructure:"pids" doc:"a sandbox's process limit (0: 4096; -1: none)"`
	Disk   string `mapstructure:"disk" type:"size" doc:"the bound on what a sandbox writes, or unlimited (none: 10G)"`
}

// ExecConfig is what the worker journals of a command: at most MaxOutput
// bytes of its output, stdout and stderr together (0: 64M).
type ExecConfig struct {
	MaxOutput int64 `mapstructure:"max_output" type:"size" doc:"what the journal keeps of a command's output, stdout and stderr together, lowered to the sandbox's disk bound; what passes it is dropped and the result says so (0: 64M)"`
}

// AdmissionConfig bounds what the worker runs (worker.Admission).
type AdmissionConfig struct {
	CPUOvercommit    float64       `mapstructure:"cpu_overcommit" doc:"CPU requests admitted per host CPU (0: 50)"`
	MemoryOvercommit float64       `mapstructure:"memory_overcommit" doc:"memory requests admitted per byte of the host's memory less host_reserve (0: 1)"`
	HostReserve      string        `mapstructure:"host_reserve" type:"size" doc:"the memory kept for the host: the kernel bounds all sandboxes together to the rest (none: 1G)"`
	MaxCreating      int           `mapstructure:"max_creating" doc:"sandboxes made at once (0: 4)"`
	QueueTimeout     time.Duration `mapstructure:"queue_timeout" doc:"the longest a create waits for admission (0: 1m)"`
	Spares           int           `mapstructure:"spares" doc:"sandbox inits kept started ahead of need (0: 2; negative: none)"`
	Primed           int           `mapstructure:"primed" doc:"sandboxes kept made ahead on the last create's layers (0: 1; negative: none)"`
	DiskFloor        string        `mapstructure:"disk_floor" type:"size" doc:"creates are refused (exit 10) while the root's file system, or the one sandboxes write to, has less free (none: 1G; negative: no floor)"`
	InodeFloor       int64         `mapstructure:"inode_floor" doc:"creates are refused while either has fewer free inodes (0: 10000; negative: no floor)"`
	UppersSize       string        `mapstructure:"uppers_size" type:"size" doc:"the size of the file system all sandboxes without a disk of their own write to, together, made once under the root (none: its free space less 1G)"`
	WorkerMemoryMin  string        `mapstructure:"worker_memory_min" type:"size" doc:"on cgroup2 hosts, the worker's and its fetchers' memory never reclaimed, memory.min of a group of their own (none: 128M; negative: off)"`
	WorkerMemoryLow  string        `mapstructure:"worker_memory_low" type:"size" doc:"on cgroup2 hosts, the worker's and its fetchers' memory reclaimed only after the rest, memory.low (none: 512M; negative: off)"`
}

// ReclaimConfig is when idle sandboxes' memory is taken back.
type ReclaimConfig struct {
	IdleAfter time.Duration `mapstructure:"idle_after" doc:"a sandbox in which no command started or ended for this long has its page cache reclaimed (0: 10m; negative: never)"`
	KSM       bool          `mapstructure:"ksm" doc:"mark every sandbox's anonymous memory mergeable by KSM (the host must run ksmd)"`
	Pressure  float64       `mapstructure:"pressure" doc:"at this memory pressure, PSI some avg10 in percent, batch sandboxes' memory is reclaimed, then they are frozen until it passes (0: 20; negative: never)"`
	HintMin   time.Duration `mapstructure:"hint_min_wait" doc:"an idle hint (sb.Idle) freezes a sandbox expected to wait at least this long, until its next exec (0: 2s; negative: hints are ignored)"`
}

// PoolFile is a FnCall pool in the config file.
type PoolFile struct {
	Size      int      `mapstructure:"size" doc:"the warm sandboxes the pool keeps"`
	Backend   string   `mapstructure:"backend" doc:"the backend of its sandboxes: container (none), microvm or vm"`
	Base      string   `mapstructure:"base" doc:"the base layer's ref"`
	Workspace string   `mapstructure:"workspace" doc:"the workspace layer's ref"`
	Toolkit   string   `mapstructure:"toolkit" doc:"the toolkit layer's ref"`
	CPU       float64  `mapstructure:"cpu" doc:"CPUs (0: no limit)"`
	Memory    string   `mapstructure:"memory" type:"size" doc:"the memory limit (none: the worker's default)"`
	Class     string   `mapstructure:"class" doc:"the scheduling class: latency (none) or batch"`
	Policy    string   `mapstructure:"policy" doc:"a stored policy's name"`
	Env       []string `mapstructure:"env" doc:"environment variables, NAME=VALUE"`
	Workdir   string   `mapstructure:"workdir" doc:"the commands' working directory"`
	User      string   `mapstructure:"user" doc:"the user commands run as: a name, a uid or uid:gid (none: root)"`
	UserNS    bool     `mapstructure:"userns" doc:"run each sandbox in a user namespace of its own"`
}

// CacheConfig is how this host mounts lazily fetched layers.
type CacheConfig struct {
	MaxBytes    int64 `mapstructure:"max_bytes" type:"size" doc:"the budget of the host cache of lazily mounted layers (0: unbounded)"`
	ReadAheadKB int   `mapstructure:"read_ahead_kb" doc:"the kernel's read-ahead on each lazy mount, in KiB, 0 to 1024 (what it reads ahead may cost a fetch)"`
	// KeepMounted: how long a layer stays mounted after its last sandbox.
	KeepMounted time.Duration `mapstructure:"keep_mounted" doc:"how long a layer stays mounted after its last sandbox goes, so that the next finds it mounted and cached (0: unmounted at once)"`
}

// maxReadAheadKB bounds cache.read_ahead_kb: a window's worth.
const maxReadAheadKB = 1024

// defaultReadAheadKB is lazy.DefaultReadAheadKB, which the client build
// (front.go) cannot import; a test keeps the two equal.
const defaultReadAheadKB = 16

type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	cfg            Config
	configFile     string // given with --config or DSEC_CONFIG
	log            *slog.Logger
}

func newApp(stdin io.Reader, stdout, stderr io.Writer) *app {
	return &app{stdin: stdin, stdout: stdout, stderr: stderr}
}

func defaultRoot() string {
	if os.Geteuid() == 0 {
		return "/var/lib/dsec"
	}
	if d := os.Getenv("XDG_DATA_HOME"); d != "" {
		return filepath.Join(d, "dsec")
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".local", "share", "dsec")
}

// sizeHook lets a byte count (cache.max_bytes) be written as sizes are
// everywhere else: 10G, 512M, or bytes.
func sizeHook(from, to reflect.Type, data any) (any, error) {
	if from.Kind() != reflect.String || to != reflect.TypeOf(int64(0)) {
		return data, nil
	}
	return units.ParseBytes(data.(string))
}

func defaultConfigFile() string {
	if os.Geteuid() == 0 {
		return "/etc/dsec/config.yaml"
	}
	if d := os.Getenv("XDG_CONFIG_HOME"); d != "" {
		return filepath.Join(d, "dsec", "config.yaml")
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".config", "dsec", "config.yaml")
}

// extraCommands are commands only some builds have (gen-docs).
var extraCommands []func(*app) *cobra.Command

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "dsec",
		Short: "Stateful sandboxes for agent training and evaluation",
		Long: `dsec builds environments as independently versioned EROFS layers (base, workspace,
toolkit), keeps them in a content-addressed store, and runs stateful sandboxes on them.

All state lives under --root. Settings come from flags, then DSEC_* environment variables, then
the config file (--config, DSEC_CONFIG, default /etc/dsec/config.yaml as root,
$XDG_CONFIG_HOME/dsec/config.yaml otherwise), then the defaults; unknown keys are an error. Every key, its type,
default and variable: docs/reference/config.md in dsec's source tree.

The help topics below (dsec help TOPIC) each name the page of docs/ that covers a task.

` + exitCodesHelp,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.configure(cmd); err != nil {
				return err
			}
			a.sayLocal(cmd)
			return nil
		},
	}
	root.SetIn(a.stdin)
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	pf := root.PersistentFlags()
	pf.String("root", defaultRoot(), "directory holding all dsec state (env DSEC_ROOT)")
	pf.String("config", "", "config file (env DSEC_CONFIG; default /etc/dsec/config.yaml as root, $XDG_CONFIG_HOME/dsec/config.yaml otherwise)")
	pf.String("log-level", "warn", "log level: debug, info, warn or error (env DSEC_LOG_LEVEL)")
	pf.String("log-format", "text", "log format on stderr: text or json (env DSEC_LOG_FORMAT)")
	pf.String("progress", "auto", "progress bars on stderr: auto (on a terminal), always or never (env DSEC_PROGRESS)")
	pf.String("host", "", "talk to the worker at tcp://HOST:PORT, not the root's (env DSEC_HOST; its token in DSEC_TOKEN)")
	pf.String("tls-ca", "", "CA file the --host worker's certificate is checked against (env DSEC_TLS_CA)")
	// Help shows the defaults in effect: what DSEC_* variables and the
	// config file say, not only what is compiled in.
	help := root.HelpFunc()
	root.SetHelpFunc(func(c *cobra.Command, args []string) {
		if a.configure(c) == nil {
			for name, v := range map[string]string{"root": a.cfg.Root, "log-level": a.cfg.LogLevel, "log-format": a.cfg.LogFormat, "progress": a.cfg.Progress} {
				if f := c.Root().PersistentFlags().Lookup(name); f != nil && !f.Changed {
					f.DefValue = v
				}
			}
		}
		help(c, args)
	})
	root.SetHelpCommand(helpCommand())
	root.AddCommand(a.versionCommand())
	root.AddCommand(helpTopics()...)
	root.AddCommand(a.sandboxCommands()...)
	root.AddCommand(a.fullCommands()...)
	for _, c := range extraCommands {
		root.AddCommand(c(a))
	}
	return root
}

// configFlags are the keys the global flags of the same names set, and
// their defaults.
var configFlags = []string{"root", "log-level", "log-format", "progress", "host", "tls-ca"}

// configDefaults are the defaults of the other keys the loader knows,
// and so the keys DSEC_* variables reach (a key it does not know comes
// from the config file alone); gen-docs writes them into
// docs/reference/config.md. Zero is the worker's default where the
// key's doc tag says one.
var configDefaults = map[string]any{
	"remote": "", "remotes": map[string]string{}, "listen": []string{}, "admin_token_file": "",
	"token": "", "client-cert": "", "client-key": "", "tls.cert": "", "tls.key": "", "tls.client_ca": "",
	"cache.max_bytes": 0, "cache.read_ahead_kb": defaultReadAheadKB, "cache.keep_mounted": "30s", "exec.max_output": 0,
	"admission.cpu_overcommit": 0.0, "admission.memory_overcommit": 0.0, "admission.host_reserve": "",
	"admission.max_creating": 0, "admission.queue_timeout": "0s", "admission.spares": 0, "admission.primed": 0,
	"admission.disk_floor": "", "admission.inode_floor": int64(0), "admission.uppers_size": "",
	"admission.worker_memory_min": "", "admission.worker_memory_low": "",
	"reclaim.idle_after": "0s", "reclaim.ksm": false, "reclaim.pressure": 0.0, "reclaim.hint_min_wait": "0s",
	"defaults.memory": "", "defaults.pids": int64(0), "defaults.disk": "",
	"e2b.listen": "", "e2b.domain": "", "e2b.http2": false, "e2b.templates": map[string]any{}, "snap.publish": false,
	"snap.max_bytes": 0, "snap.max_entries": 0, "snap.max_depth": 0,
	"microvm.kernel": "", "microvm.accel": "", "microvm.qemu": "", "microvm.agent": "", "microvm.boot_timeout": "0s",
	"vm.accel": "", "vm.qemu": "", "vm.boot_timeout": "0s", "vm.max_chain": 0,
	"dns.upstream": []string{}, "dns.min_ttl": "0s", "dns.grace": "0s",
	"api.max_requests": 0, "api.max_requests_per_token": 0, "registries.compress": false,
}

// configHooks decode what the config file and DSEC_* variables write
// as text: sizes, durations, comma-separated lists.
var configHooks = viper.DecodeHook(mapstructure.ComposeDecodeHookFunc(sizeHook, mapstructure.StringToTimeDurationHookFunc(), mapstructure.StringToSliceHookFunc(",")))

// configure resolves the configuration once, before any command runs.
func (a *app) configure(cmd *cobra.Command) error {
	v := viper.New()
	v.SetEnvPrefix("DSEC")
	v.SetEnvKeyReplacer(configEnvReplacer)
	v.AutomaticEnv()
	flags := cmd.Root().PersistentFlags()
	for _, name := range configFlags {
		f := flags.Lookup(name)
		v.SetDefault(name, f.DefValue)
		if err := v.BindPFlag(name, f); err != nil {
			return err
		}
	}
	for k, d := range configDefaults {
		v.SetDefault(k, d)
	}
	file, explicit := configFile(flags)
	if explicit {
		a.configFile = file
	}
	v.SetConfigFile(file)
	v.SetConfigType("yaml")
	from := "config file " + file + " or DSEC_* variables" // what a setting that cannot be decoded came from
	if err := v.ReadInConfig(); err != nil {
		var pe *fs.PathError
		if explicit && errors.As(err, &pe) && errors.Is(err, fs.ErrNotExist) {
			return usageError{fmt.Errorf("config file %s does not exist: give an existing file to --config (or DSEC_CONFIG), or none for the default", file)}
		}
		if explicit || !errors.As(err, &pe) {
			return usageError{fmt.Errorf("config file %s: %v", file, err)}
		}
		from = "DSEC_* variables (no config file at " + file + ")"
	}
	if err := v.UnmarshalExact(&a.cfg, configHooks); err != nil {
		return usageError{configError(from, err)}
	}
	if ra := a.cfg.Cache.ReadAheadKB; ra < 0 || ra > maxReadAheadKB {
		return usageError{fmt.Errorf("cache.read_ahead_kb %d: use 0 (none) to %d", ra, maxReadAheadKB)}
	}
	if a.cfg.API.MaxRequests < 0 || a.cfg.API.MaxRequestsPerToken < 0 {
		return usageError{fmt.Errorf("api.max_requests %d, api.max_requests_per_token %d: give positive bounds, or 0 for the defaults",
			a.cfg.API.MaxRequests, a.cfg.API.MaxRequestsPerToken)}
	}
	if n := a.cfg.Exec.MaxOutput; n < 0 {
		return usageError{fmt.Errorf("exec.max_output %d: give a size such as 64M (0: the default, 64M)", n)}
	}
	if d := a.cfg.Cache.KeepMounted; d < 0 {
		return usageError{fmt.Errorf("cache.keep_mounted %v: give a duration of 0 (unmount at once) or more, such as 30s", d)}
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(a.cfg.LogLevel)); err != nil {
		return usageError{fmt.Errorf("bad log level %q: use debug, info, warn or error", a.cfg.LogLevel)}
	}
	opts := &slog.HandlerOptions{Level: level}
	switch a.cfg.LogFormat {
	case "text":
		a.log = slog.New(slog.NewTextHandler(a.stderr, opts))
	case "json":
		a.log = slog.New(slog.NewJSONHandler(a.stderr, opts))
	default:
		return usageError{fmt.Errorf("bad log format %q: use text or json", a.cfg.LogFormat)}
	}
	slog.SetDefault(a.log) // what packages log on their own goes the same way
	switch a.cfg.Progress {
	case "auto", "always", "never":
	default:
		return usageError{fmt.Errorf("bad progress mode %q: use auto, always or never", a.cfg.Progress)}
	}
	if a.cfg.Root == "" {
		return usageError{errors.New("--root is empty: give the directory that holds dsec's state")}
	}
	cmd.SetContext(dlog.With(cmd.Context(), a.log))
	return nil
}

// configError says which setting could not be decoded and where it
// came from: the DSEC_* variable that set it, else the config file.
func configError(from string, err error) error {
	msg := strings.Join(strings.Fields(strings.ReplaceAll(err.Error(), "decoding failed due to the following error(s):", "")), " ")
	msg = strings.ReplaceAll(msg, ": invalid argument", "")
	if where, keys, ok := strings.Cut(msg, " has invalid keys: "); ok {
		if where = strings.Trim(where, "'"); where != "" {
			keys += " under " + where
		}
		return fmt.Errorf("%s: unknown keys %s (dsec help config lists every key)",
			strings.TrimSuffix(from, " or DSEC_* variables"), keys)
	}
	if key, rest, ok := strings.Cut(strings.TrimPrefix(msg, "'"), "' "); ok {
		env := configEnv(key)
		if v := os.Getenv(env); v != "" {
			return fmt.Errorf("%s=%s: %s", env, v, rest)
		}
		return fmt.Errorf("%s: %s: %s", strings.TrimSuffix(from, " or DSEC_* variables"), key, rest)
	}
	return fmt.Errorf("%s: %s", from, msg)
}

func configFile(flags *pflag.FlagSet) (string, bool) {
	if f := flags.Lookup("config"); f.Changed {
		return f.Value.String(), true
	}
	if env := os.Getenv("DSEC_CONFIG"); env != "" {
		return env, true
	}
	return defaultConfigFile(), false
}

// storeDir is the local layer store under the root.
func (a *app) storeDir() string { return filepath.Join(a.cfg.Root, "store") }

// showProgress says whether to draw progress bars on stderr.
func (a *app) showProgress() bool {
	switch a.cfg.Progress {
	case "always":
		return true
	case "never":
		return false
	}
	f, ok := a.stderr.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// nameResult is one name of a command over several (stop, start, pause,
// resume, rm, snap rm, pool rm) in its --json list.
type nameResult struct {
	Name  string `json:"name"`
	Error string `json:"error,omitempty"`
}

// eachName calls fn for every name, on past failures, and prints each
// name done (or, asJSON, every name with its error); the failures
// but the last go to stderr, the last is the command's error.
func (a *app) eachName(names []string, asJSON bool, fn func(string) error) error {
	var errs []error
	var out []nameResult
	for _, name := range names {
		err := fn(name)
		r := nameResult{Name: name}
		if err != nil {
			errs = append(errs, err)
			r.Error = userMessage(err)
		} else if !asJSON {
			fmt.Fprintln(a.stdout, name)
		}
		out = append(out, r)
	}
	if asJSON {
		if err := a.printJSON(out); err != nil {
			return err
		}
	}
	if len(errs) == 0 {
		return nil
	}
	for _, e := range errs[:len(errs)-1] {
		fmt.Fprintf(a.stderr, "dsec: %s\n", userMessage(e))
	}
	return errs[len(errs)-1]
}

// localAnnotation marks a command (and those under it) that acts on
// this machine's root whatever --host says: layers, images, tokens, the
// worker, a gateway.
const localAnnotation = "dsec.local"

// sayLocal tells a user who gave --host that cmd acts here.
func (a *app) sayLocal(cmd *cobra.Command) {
	if a.cfg.Host == "" {
		return
	}
	for c := cmd; c != nil; c = c.Parent() {
		if c.Annotations[localAnnotation] != "" {
			fmt.Fprintf(a.stderr, "dsec: %s acts on this machine's root (%s), not on the worker at %s\n", cmd.CommandPath(), a.cfg.Root, a.cfg.Host)
			return
		}
	}
}

func (a *app) printJSON(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// noArgs and friends wrap cobra's validators so that a wrong argument
// count exits with the usage code.
func exactArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			what := fmt.Sprintf("%d arguments", n)
			switch n {
			case 0:
				what = "no arguments"
			case 1:
				what = "1 argument"
			}
			return usageError{fmt.Errorf("%s takes %s, not %d: usage: %s (see --help)", cmd.CommandPath(), what, len(args), cmd.UseLine())}
		}
		return nil
	}
}

// minArgs is exactArgs for at least n arguments.
func minArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) < n {
			return usageError{fmt.Errorf("%s takes at least %d argument(s), not %d: usage: %s (see --help)", cmd.CommandPath(), n, len(args), cmd.UseLine())}
		}
		return nil
	}
}

func (a *app) versionCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "Print dsec's version, the limits its worker holds sandboxes to and the host features it lacks",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			// The root's worker, if one serves it (none is started): its
			// version and the limits it holds sandboxes to.
			var w *api.VersionInfo
			if c, err := sdk.New(a.sdkOptions()); err == nil {
				if v, err := c.Version(cmd.Context()); err == nil {
					w = &v
				}
			}
			if asJSON {
				return a.printJSON(struct {
					Version string           `json:"version"`
					Worker  *api.VersionInfo `json:"worker,omitempty"`
				}{version, w})
			}
			fmt.Fprintln(a.stdout, version)
			if w == nil {
				fmt.Fprintln(a.stderr, "dsec: no worker serves this root: the limits it holds sandboxes to and the host features it lacks show once one runs (dsec daemon, or any command that needs it)")
			}
			if w != nil && w.Limits != nil {
				l := w.Limits
				fmt.Fprintf(a.stdout, "worker %s (pid %d): all sandboxes together %s and %d pids (the host keeps %s), %s of disk; each by default %s, %d pids and %s of disk\n",
					w.Version, w.Pid, humanBytes(l.MemoryBytes), l.Pids, humanBytes(l.HostReserve), humanBytes(l.DiskBytes), humanBytes(l.DefaultMemory), l.DefaultPids,
					humanBytes(l.DefaultDisk))
				if l.WorkerMemoryMin > 0 || l.WorkerMemoryLow > 0 {
					fmt.Fprintf(a.stdout, "the worker's memory is protected in %s: %s never reclaimed, %s only after the rest\n",
						l.WorkerGroup, humanBytes(l.WorkerMemoryMin), humanBytes(l.WorkerMemoryLow))
				}
			}
			if m := w.GetMicroVM(); m != nil {
				if m.Error != "" {
					fmt.Fprintf(a.stdout, "microVMs: none on this host: %s\n", m.Error)
				} else {
					fmt.Fprintf(a.stdout, "microVMs: accelerator %s (%s), guest kernel %s, %s\n", m.Accel, m.AccelWhy, m.Kernel, m.QEMU)
				}
			}
			if w != nil {
				for _, f := range w.Features {
					if !f.Available {
						fmt.Fprintf(a.stdout, "this host lacks %s: %s; so %s\n", f.Name, f.Reason, f.Without)
					}
				}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
