//go:build !front

package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/containerd/errdefs"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/gateway"
	"github.com/dsec-project/dsec/internal/gateway/kube"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

func (a *app) gatewayCommand() *cobra.Command {
	var f gatewayFlags
	cmd := &cobra.Command{
		Use:         "gateway",
		Short:       "Serve one API for a fleet of workers, each sandbox on the worker that holds it",
		Annotations: map[string]string{localAnnotation: "true"},
		Long: `Gateway serves the API of a worker (as dsec daemon --listen does) for a fleet of workers:
the CLI, the SDKs and scripts point at it (dsec --host, DSEC_HOST) exactly as at one worker.
A create goes to a worker whose admission takes it at once (CPU and memory requests, queue,
disk floors) with the most memory left to give (its bound on all sandboxes, less its sandboxes'
limits); a request about a sandbox
goes to the worker that holds it, streamed both ways (an exec's input and output); a list
asks every worker; a batch (POST /v1/batches, the SDKs' batch) places each of its sandboxes
as a create is. The gateway keeps nothing of its own: each worker lists what it holds at
every heartbeat (--heartbeat, default 2 s), so a gateway started again, or a second one
beside it, routes as the first did. Names are the fleet's, through any number of gateways: a
create of a name some worker held at its last heartbeat is refused, and a create claims its
name first on the name's home, a worker all gateways pick alike, which refuses a name another
create holds.

Clients hold the gateway's own tokens (dsec token create on the gateway's --root, or the file
gateway.tokens_file names, which replicas share: a Kubernetes Secret's); the
gateway speaks to each worker with an admin token of that worker's (--worker-token), over
TLS checked against --worker-ca (with --worker-cert and --worker-key for a worker that asks
for a client certificate), and has the worker serve each request as its client's
token: a token of scope sandboxes sees only its own sandboxes, on every worker. A token's
quota holds across the fleet: each worker is told it less what the token's sandboxes hold on
the others.

A worker that does not answer for three heartbeats is down: its sandboxes are listed as
unreachable, a request about one fails at once as an infrastructure failure (exit 9; 255
from run and exec), and no create goes there until it answers again. dsec node ls shows the
workers; dsec node cordon stops creates going to one (the worker keeps it: every gateway sees
it), dsec node drain waits for its sandboxes to go too.

With --e2b-listen HOST:PORT (config e2b.listen, with e2b.templates, e2b.domain and e2b.http2 as
dsec daemon takes them) it serves E2B's API for the fleet too: E2B_API_URL and E2B_SANDBOX_URL
point at it, E2B_API_KEY is a token of the gateway's (dsec token create --e2b on its root). It
keeps no E2B state: each sandbox's (its record, timeout and commands) is kept by the E2B front
of the worker that holds it, where every request about that sandbox is relayed, so any number
of replicas serve E2B's API alike (give them one set of tokens, gateway.tokens_file, and one
admin token per worker: the sandboxes the admin makes are that token's on the worker).

On Kubernetes (deploy/kubernetes), --kubernetes-service NAMESPACE/NAME (config gateway.kubernetes.service,
.port, .kubeconfig: default the pod's service account) finds the workers as that Service's endpoints, each
reached as gateway.kubernetes.worker says (token_file, ca, server_name, cert, key): one joins as its endpoint
appears, and one gone from them leaves once it does not answer either. The gateway then also applies the
namespace's SandboxPolicy, SandboxTemplate and SandboxPool objects (group dsec.dev) to every worker, with
their status: one replica at a time, the holder of the Lease dsec-gateway; with --e2b-listen, each
SandboxTemplate's name is an E2B template ID too. admin_token_file (DSEC_ADMIN_TOKEN_FILE) gives the gateway an admin token from a file besides
its root's tokens.

Snapshots: a pack-diff is taken where its sandbox runs; snap ls and rm ask every worker; a branch
or a create on a snapshot goes to a worker that holds it (a memory snapshot's guest runs there), or
to any worker when the workers share a remote they publish snapshots to (snap.publish). Stored
policies are stored on every worker up; a pool's size is split over the workers up and not
cordoned; their lists are the fleet's. A squash (an admin's) runs on a worker that holds the chain
(published, as a pack is, by a worker that publishes its snapshots).

` + exitCodesHelp,
		Example: `  dsec --root /var/lib/dsec-gw token create --scope admin      # the gateway's own tokens
  dsec --root /var/lib/dsec-gw gateway --listen tcp://0.0.0.0:7443 \
      --tls-cert gw.pem --tls-key gw-key.pem \
      --worker tcp://host1:7443 --worker tcp://host2:7443 --worker-token dsec_... --worker-ca ca.pem
  DSEC_HOST=tcp://gw:7443 DSEC_TOKEN=dsec_... dsec run --name a -- true
  dsec --root /var/lib/dsec-gw gateway --listen tcp://0.0.0.0:7444 --kubernetes-service dsec/dsec-worker
  dsec --root /var/lib/dsec-gw gateway --listen tcp://127.0.0.1:7443 --e2b-listen 127.0.0.1:3000 \
      --worker tcp://127.0.0.1:7001 --worker tcp://127.0.0.1:7002 --worker-token dsec_... --worker-ca ca.pem`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.runGateway(cmd, f)
		},
	}
	f.register(cmd.Flags())
	return cmd
}

// gatewayFlags are dsec gateway's flags: each one given overrides the
// config's.
type gatewayFlags struct {
	listen, workers, tokens, cas, certs, keys, names []string
	service                                          string
	e2bListen                                        string
	tls                                              ServerTLSConfig
	heartbeat                                        time.Duration
}

func (f *gatewayFlags) register(fl *pflag.FlagSet) {
	fl.StringArrayVar(&f.listen, "listen", nil, "serve the fleet's API on tcp://HOST:PORT (repeatable; config gateway.listen)")
	fl.StringArrayVar(&f.workers, "worker", nil, "a worker's TCP API, tcp://HOST:PORT (repeatable; config gateway.workers)")
	fl.StringArrayVar(&f.tokens, "worker-token", nil, "an admin token of the worker's: one for all, or one per --worker in order")
	fl.StringArrayVar(&f.cas, "worker-ca", nil, "the CA the worker's certificate is checked against: one for all, or one per --worker")
	fl.StringArrayVar(&f.certs, "worker-cert", nil, "the gateway's client certificate, for workers that ask for one: one for all, or one per --worker")
	fl.StringArrayVar(&f.keys, "worker-key", nil, "its key: one for all, or one per --worker")
	fl.StringArrayVar(&f.names, "worker-server-name", nil, "the name the worker's certificate must bear, when not its address: one for all, or one per --worker")
	fl.StringVar(&f.service, "kubernetes-service", "", "find the workers as the endpoints of this Kubernetes Service, NAMESPACE/NAME (config gateway.kubernetes.service; with gateway.kubernetes.worker: token_file, ca, server_name)")
	fl.StringVar(&f.tls.Cert, "tls-cert", "", "the gateway's TLS certificate (config tls.cert; needed off loopback)")
	fl.StringVar(&f.tls.Key, "tls-key", "", "its key (config tls.key)")
	fl.StringVar(&f.tls.ClientCA, "tls-client-ca", "", "take only clients with a certificate this CA signed (config tls.client_ca)")
	fl.StringVar(&f.e2bListen, "e2b-listen", "", "serve E2B's API for the fleet on HOST:PORT, for the E2B SDKs (config e2b.listen)")
	fl.DurationVar(&f.heartbeat, "heartbeat", 0, "ask each worker how it is this often (default 2s; config gateway.heartbeat)")
}

// runGateway is dsec gateway: it listens, then serves the fleet's API
// (and E2B's, with --e2b-listen) until cmd's context ends.
func (a *app) runGateway(cmd *cobra.Command, f gatewayFlags) error {
	c, tls, e2bAddr, err := a.gatewaySettings(cmd.Flags(), f)
	if err != nil {
		return err
	}
	cfg, kcfg, err := a.gatewayConfig(c)
	if err != nil {
		return err
	}
	g, err := gateway.New(cfg)
	if err != nil {
		return err
	}
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for _, addr := range c.Listen {
		l, err := worker.ListenTCP(addr, tls, false)
		if err != nil {
			return err
		}
		ls = append(ls, l)
	}
	var e2bL net.Listener
	if e2bAddr != "" {
		if e2bL, err = worker.ListenTCP("tcp://"+strings.TrimPrefix(e2bAddr, "tcp://"), tls, a.cfg.E2B.HTTP2); err != nil {
			return err
		}
		ls = append(ls, e2bL)
	}
	ctx, cancel := context.WithCancel(cmd.Context())
	defer cancel()
	g.Heartbeat(ctx)
	go g.Run(ctx)
	var front *e2b.Server
	if e2bL != nil {
		var stop func()
		if front, stop, err = a.gatewayFront(ctx, g, cfg.Tokens); err != nil {
			return err
		}
		defer stop()
	}
	if kcfg != nil {
		a.gatewayObjects(ctx, *kcfg, g, front)
	}
	return a.serveGateway(ctx, g, front, ls, e2bL, len(cfg.Workers))
}

// gatewaySettings are the gateway's config with the flags given over
// it: the gateway's part, its TLS and the address of its E2B front
// ("": none).
func (a *app) gatewaySettings(fl *pflag.FlagSet, f gatewayFlags) (GatewayConfig, worker.TLS, string, error) {
	c := a.cfg.Gateway
	if fl.Changed("listen") {
		c.Listen = f.listen
	}
	if fl.Changed("heartbeat") {
		c.Heartbeat = f.heartbeat
	}
	if fl.Changed("worker") {
		ws, err := gatewayWorkers(f.workers, map[string][]string{"worker-token": f.tokens, "worker-ca": f.cas, "worker-cert": f.certs, "worker-key": f.keys,
			"worker-server-name": f.names})
		if err != nil {
			return c, worker.TLS{}, "", err
		}
		c.Workers = ws
	}
	tls := worker.TLS{Cert: a.cfg.TLS.Cert, Key: a.cfg.TLS.Key, ClientCA: a.cfg.TLS.ClientCA}
	if fl.Changed("tls-cert") {
		tls.Cert = f.tls.Cert
	}
	if fl.Changed("tls-key") {
		tls.Key = f.tls.Key
	}
	if fl.Changed("tls-client-ca") {
		tls.ClientCA = f.tls.ClientCA
	}
	e2bAddr := a.cfg.E2B.Listen
	if fl.Changed("e2b-listen") {
		e2bAddr = f.e2bListen
	}
	if len(c.Listen) == 0 {
		return c, tls, e2bAddr, fmt.Errorf("the gateway listens nowhere: give --listen tcp://HOST:PORT (config gateway.listen): %w", errdefs.ErrInvalidArgument)
	}
	if fl.Changed("kubernetes-service") {
		c.Kubernetes.Service = f.service
	}
	return c, tls, e2bAddr, nil
}

// gatewayConfig is the gateway's for c: its clients' tokens, its
// workers, and with a Kubernetes Service the workers found as its
// endpoints (and the config of that, for the cluster's objects; nil
// without one).
func (a *app) gatewayConfig(c GatewayConfig) (gateway.Config, *kube.Config, error) {
	store := auth.Open(a.cfg.Root)
	if c.TokensFile != "" {
		store = auth.OpenFile(c.TokensFile)
	}
	cfg := gateway.Config{Tokens: store, Heartbeat: c.Heartbeat, Version: version, Log: a.log}
	if a.cfg.AdminTokenFile != "" {
		if err := cfg.Tokens.PinAdminFile(a.cfg.AdminTokenFile); err != nil {
			return cfg, nil, err
		}
	}
	for _, w := range c.Workers {
		gw, err := w.worker()
		if err != nil {
			return cfg, nil, err
		}
		cfg.Workers = append(cfg.Workers, gw)
	}
	var kcfg *kube.Config
	if k := c.Kubernetes; k.Service != "" {
		gw, err := k.Worker.worker()
		if err != nil {
			return cfg, nil, err
		}
		kcfg = &kube.Config{Service: k.Service, Port: k.Port, Kubeconfig: k.Kubeconfig, Worker: gw}
		if cfg.Discover, err = kube.Discover(*kcfg); err != nil {
			return cfg, nil, err
		}
	}
	return cfg, kcfg, nil
}

// gatewayObjects applies the namespace's SandboxPolicy, SandboxTemplate
// and SandboxPool objects to the fleet g serves, in the background until
// ctx ends; with front, each SandboxTemplate is an E2B template ID too.
func (a *app) gatewayObjects(ctx context.Context, kcfg kube.Config, g *gateway.Gateway, front *e2b.Server) {
	var templates func(map[string]api.SandboxSpec)
	if front != nil {
		templates = front.SetTemplates // (a SandboxTemplate is a template ID)
	}
	go func() {
		// Again after it ends (its Lease lost to another
		// replica, the API server gone a while): a replica
		// stands for the Lease and lists templates for good.
		for ctx.Err() == nil {
			if err := kube.Objects(ctx, kcfg, g.ActAs(), a.log, templates); err != nil && ctx.Err() == nil {
				a.log.Error("the fleet's Kubernetes objects (SandboxPolicy, SandboxTemplate, SandboxPool): again in 5s", "err", err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
			}
		}
	}()
}

// serveGateway serves g on the listeners ls, and front on e2bL (one of
// them, or nil), until ctx ends (then shuts the servers down, for up to
// 5 s) or one of them fails.
func (a *app) serveGateway(ctx context.Context, g *gateway.Gateway, front *e2b.Server, ls []net.Listener, e2bL net.Listener, workers int) error {
	errLog := slog.NewLogLogger(a.log.Handler(), slog.LevelDebug) // a failed handshake is anyone's knock (a probe's)
	srv := &http.Server{Handler: g, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10, ErrorLog: errLog}
	servers := []*http.Server{srv}
	errc := make(chan error, len(ls))
	for _, l := range ls {
		if l == e2bL {
			continue
		}
		a.log.Info("the gateway listens", "addr", l.Addr().String(), "workers", workers)
		go func() { errc <- srv.Serve(l) }()
	}
	if e2bL != nil {
		fsrv := &http.Server{Handler: front, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10, ErrorLog: errLog}
		servers = append(servers, fsrv)
		a.log.Info("the gateway serves E2B's API", "addr", e2bL.Addr().String())
		go func() { errc <- fsrv.Serve(e2bL) }()
	}
	select {
	case <-ctx.Done():
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		for _, s := range servers {
			s.Shutdown(sctx)
		}
		return nil
	case err := <-errc:
		return err
	}
}

// gatewayFront is the E2B front for the fleet g serves: it checks keys
// against the gateway's tokens and calls g in process with the caller's
// authority (g.ActAs); it keeps nothing of its own (each sandbox's E2B
// state is its worker's front's, e2b.Fleet), so every replica serves
// alike.
func (a *app) gatewayFront(ctx context.Context, g *gateway.Gateway, tokens *auth.Store) (*e2b.Server, func(), error) {
	templates, err := a.e2bTemplates()
	if err != nil {
		return nil, nil, err
	}
	transport, stop := e2b.InProcess(ctx, g.ActAs())
	front, err := e2b.New(e2b.Options{Transport: transport, Fleet: g, Templates: templates,
		Domain: a.cfg.E2B.Domain, ImageKeys: a.cfg.E2B.ImageKeys, Log: a.log,
		Authorize: func(key string) (string, bool, error) {
			t, err := tokens.Check(key, time.Now())
			return t.ID, t.Scope == auth.Admin, err
		},
		Live: func(id string) bool {
			t, ok := tokens.Lookup(id)
			return ok && !t.Expired(time.Now())
		}})
	if err != nil {
		stop()
		return nil, nil, err
	}
	return front, stop, nil
}

// gatewayWorkers pairs --worker with --worker-token, --worker-ca,
// --worker-cert and --worker-key (each, by its flag's name): each given
// once for all, or once per worker, in order.
func gatewayWorkers(urls []string, each map[string][]string) ([]GatewayWorker, error) {
	pick := func(what string, i int) (string, error) {
		switch vs := each[what]; len(vs) {
		case 0:
			return "", nil
		case 1:
			return vs[0], nil
		case len(urls):
			return vs[i], nil
		default:
			return "", fmt.Errorf("%d --%s for %d --worker: give one for all, or one per worker in order: %w", len(vs), what, len(urls), errdefs.ErrInvalidArgument)
		}
	}
	var out []GatewayWorker
	for i, u := range urls {
		w := GatewayWorker{URL: u}
		for _, f := range []struct {
			flag string
			to   *string
		}{{"worker-token", &w.Token}, {"worker-ca", &w.CA}, {"worker-cert", &w.Cert}, {"worker-key", &w.Key}, {"worker-server-name", &w.ServerName}} {
			v, err := pick(f.flag, i)
			if err != nil {
				return nil, err
			}
			*f.to = v
		}
		out = append(out, w)
	}
	return out, nil
}

// worker is w as the gateway reaches it, its token read from TokenFile
// if it has one.
func (w GatewayWorker) worker() (gateway.Worker, error) {
	token := w.Token
	if w.TokenFile != "" {
		b, err := os.ReadFile(w.TokenFile)
		if err != nil {
			return gateway.Worker{}, fmt.Errorf("the workers' token file: %w", err)
		}
		token = strings.TrimSpace(string(b))
	}
	return gateway.Worker{URL: w.URL, Token: token, CA: w.CA, Cert: w.Cert, Key: w.Key, ServerName: w.ServerName}, nil
}

func (a *app) nodeCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "node",
		Short: "See, cordon and drain the workers of a gateway's fleet (dsec --host GATEWAY)",
		Long: `Node lists the workers of the fleet the gateway at --host serves (dsec gateway), and stops
(cordon) or lets again (uncordon) creates going to one; its sandboxes run on and are served
as before; the worker keeps its cordon, so every gateway of the fleet sees it. Drain cordons
one and waits until its sandboxes are gone (they are not moved). These take an admin token
of the gateway's.

` + exitCodesHelp,
		Example: `  dsec --host tcp://gw:7443 node ls
  dsec --host tcp://gw:7443 node cordon tcp://host2:7443
  dsec --host tcp://gw:7443 node drain host2:7443 --wait 1h   # cordon, then wait for its sandboxes to go
  dsec --host tcp://gw:7443 node ls --json | jq '.[] | select(.up | not) | .url'`,
	}
	cmd.AddCommand(a.nodeLs(), a.nodeCordon("cordon", "Place no more creates on a worker (its sandboxes run on)", true),
		a.nodeCordon("uncordon", "Place creates on a worker again", false), a.nodeDrain())
	return cmd
}

// nodeLs is dsec node ls.
func (a *app) nodeLs() *cobra.Command {
	var asJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the workers: up or down, sandboxes, memory left to place",
		Args:  exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.gatewayClient()
			if err != nil {
				return err
			}
			nodes, err := c.Nodes(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(nodes)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "WORKER\tSTATE\tSANDBOXES\tMEMORY FREE\tCPU REQUESTS\tQUEUED\tVERSION\tERROR")
			for _, n := range nodes {
				state := "up"
				switch {
				case !n.Up:
					state = "down"
				case n.Cordoned:
					state = "cordoned"
				}
				cpu, queued := "-", "-"
				if c := n.Capacity; c != nil {
					cpu, queued = fmt.Sprintf("%g/%g", c.CPURequestsUsed, c.CPURequests), strconv.Itoa(c.Queued)
					if c.DiskFull != "" {
						state += ", disk full"
					}
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", n.URL, state, n.Sandboxes, humanBytes(n.MemoryFree), cpu, queued, n.Version, n.Error)
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print JSON (an array of nodes)")
	return ls
}

// nodeCordon is dsec node cordon (on) or uncordon.
func (a *app) nodeCordon(use, short string, on bool) *cobra.Command {
	return &cobra.Command{
		Use:   use + " WORKER",
		Short: short,
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.gatewayClient()
			if err != nil {
				return err
			}
			return c.Cordon(cmd.Context(), args[0], on)
		},
	}
}

// nodeDrain is dsec node drain.
func (a *app) nodeDrain() *cobra.Command {
	var wait time.Duration
	drain := &cobra.Command{
		Use:   "drain WORKER",
		Short: "Cordon a worker, and wait until none of its sandboxes is left",
		Long: `Drain cordons the worker (no create goes there), then waits, up to --wait, until it holds
no sandbox: its sandboxes are not moved, but run on until their owners remove them. Past
--wait it says how many are left and exits 10 (busy); the worker stays cordoned.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.gatewayClient()
			if err != nil {
				return err
			}
			if err := c.Cordon(cmd.Context(), args[0], true); err != nil {
				return err
			}
			deadline := time.Now().Add(wait)
			for {
				nodes, err := c.Nodes(cmd.Context())
				if err != nil {
					return err
				}
				left := -1
				for _, n := range nodes {
					if n.URL == args[0] || strings.TrimPrefix(n.URL, "tcp://") == args[0] {
						left = n.Sandboxes
					}
				}
				switch {
				case left == 0:
					fmt.Fprintf(a.stderr, "drained %s: no sandbox left\n", args[0])
					return nil
				case time.Now().After(deadline):
					return fmt.Errorf("%s still holds %d sandboxes after %v: it stays cordoned (dsec node uncordon undoes it): %w",
						args[0], left, wait, errdefs.ErrResourceExhausted)
				}
				select {
				case <-cmd.Context().Done():
					return cmd.Context().Err()
				case <-time.After(time.Second):
				}
			}
		},
	}
	drain.Flags().DurationVar(&wait, "wait", 10*time.Minute, "how long to wait for its sandboxes to go")
	return drain
}

// gatewayClient is a client of the gateway at --host.
func (a *app) gatewayClient() (*sdk.Client, error) {
	if a.cfg.Host == "" {
		return nil, fmt.Errorf("dsec node talks to a gateway: give --host tcp://GATEWAY:PORT (DSEC_HOST) and its admin token (DSEC_TOKEN): %w", errdefs.ErrInvalidArgument)
	}
	return a.client()
}
