//go:build !front

package main

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/dsec-project/dsec/internal/auth"
)

func (a *app) tokenCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "token",
		Short: "Make and remove the tokens the worker's TCP API takes (on this machine's root)",
		Long: `Token manages the tokens a worker listening on TCP (dsec daemon --listen) takes: every
request over TCP carries one (DSEC_TOKEN, or token: in the config, on the client). They are
stored hashed in <root>/tokens.json; the worker reads a change at once. A token is shown
whole only when it is made.

A token of scope admin may do everything. One of scope sandboxes creates sandboxes and sees
and acts only on those it created, the snapshots taken of them and their branches; another
token's are not found, as if they did not exist, and what only the admin does (pools, stored
policies, squash, stopping the worker) is refused. Its sandboxes stand on the layers the
admin built or pulled and on its own snapshots, whose tags live in a namespace of its own
(tenants/ID/ in the store, shown to it without that prefix). The worker's unix socket takes
no token: its file permissions are its guard.

A token of scope sandboxes may be given more (--allow): policy, to give its sandboxes
policies of its own (inline at create, and policy apply); without it they run under the
default policy, a stored policy named at create, or their template's, and keep it; and
unlimited, to ask for no memory, pids or disk limit, or more than the host has. --policy
names the stored policies it may name (it sees no other). Its quota (--max-*) bounds what its
sandboxes and snapshots hold at once; a create or pack-diff past it is refused (exit 10).

These commands act on this machine's root (--root), never on a --host worker.

` + exitCodesHelp,
		Example: `  dsec token create --scope sandboxes --ttl 24h   # print a token for one trainer
  dsec token create --max-sandboxes 256 --max-memory 512G --max-disk 2T
  dsec token create --allow policy                # its sandboxes may get policies of their own
  dsec token create --e2b                         # an E2B_API_KEY for the E2B SDKs
  dsec token ls
  dsec token rm 3f2a9c1b`,
		Annotations: map[string]string{localAnnotation: "true"},
	}
	cmd.AddCommand(a.tokenCreate(), a.tokenList(), a.tokenRemove())
	return cmd
}

// tokenCreate is dsec token create.
func (a *app) tokenCreate() *cobra.Command {
	var scope string
	var ttl time.Duration
	var asJSON, e2bKey bool
	var allow, policies []string
	var maxSandboxes int
	var maxMemory, maxDisk, maxSnapshots string
	create := &cobra.Command{
		Use:   "create",
		Short: "Make a token and print it (the only time it is shown)",
		Args:  exactArgs(0),
		RunE: func(*cobra.Command, []string) error {
			spec := auth.Spec{Scope: scope, TTL: ttl, Prefix: auth.Prefix, Allow: allow, Quota: auth.Quota{Sandboxes: maxSandboxes}, Policies: policies}
			if e2bKey {
				spec.Prefix = auth.E2BPrefix
			}
			for _, f := range []struct {
				v   string
				out *int64
			}{{maxMemory, &spec.Quota.Memory}, {maxDisk, &spec.Quota.Disk}, {maxSnapshots, &spec.Quota.SnapshotBytes}} {
				if f.v == "" {
					continue
				}
				n, err := parseBytes(f.v)
				if err != nil {
					return err
				}
				*f.out = n
			}
			secret, t, err := auth.Open(a.cfg.Root).New(spec)
			if err != nil {
				return err
			}
			if asJSON {
				return a.printJSON(struct {
					auth.Token
					Secret string `json:"token"`
				}{t, secret})
			}
			fmt.Fprintln(a.stdout, secret)
			return nil
		},
	}
	create.Flags().StringVar(&scope, "scope", auth.Sandboxes, "admin (everything) or sandboxes (its own sandboxes, snapshots and branches)")
	create.Flags().DurationVar(&ttl, "ttl", 0, "how long it is valid, e.g. 24h (0: until removed)")
	create.Flags().BoolVar(&asJSON, "json", false, "print the token with its id, scope and expiry as JSON")
	create.Flags().BoolVar(&e2bKey, "e2b", false, "shape it as an E2B API key, e2b_<40 hex> (E2B_API_KEY for dsec daemon --e2b-listen)")
	create.Flags().StringSliceVar(&allow, "allow", nil, "what a sandboxes token may do beyond the basics: policy (its own policies), unlimited (no memory, pids or disk limit)")
	create.Flags().StringSliceVar(&policies, "policy", nil, "the stored policies its sandboxes may name, besides the default (repeatable; none: any)")
	create.Flags().IntVar(&maxSandboxes, "max-sandboxes", 0, "its sandboxes at once, stopped and queued ones included (0: no bound)")
	create.Flags().StringVar(&maxMemory, "max-memory", "", "the sum of its sandboxes' memory limits, e.g. 64G (none: no bound)")
	create.Flags().StringVar(&maxDisk, "max-disk", "", "the sum of its sandboxes' disk bounds, e.g. 1T (none: no bound)")
	create.Flags().StringVar(&maxSnapshots, "max-snapshot-bytes", "", "the bytes of its snapshots in the store, e.g. 100G (none: no bound)")
	return create
}

// tokenList is dsec token ls.
func (a *app) tokenList() *cobra.Command {
	var lsJSON bool
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the tokens (their ids, never the tokens)",
		Args:  exactArgs(0),
		RunE: func(*cobra.Command, []string) error {
			ts, err := auth.Open(a.cfg.Root).List()
			if err != nil {
				return err
			}
			if lsJSON {
				if ts == nil {
					ts = []auth.Token{}
				}
				return a.printJSON(ts)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSCOPE\tCREATED\tEXPIRES\tALLOW\tPOLICIES\tQUOTA")
			now := time.Now()
			for _, t := range ts {
				exp := "never"
				if !t.Expires.IsZero() {
					exp = t.Expires.Local().Format(time.DateTime)
					if t.Expired(now) {
						exp += " (expired)"
					}
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.ID, t.Scope, t.Created.Local().Format(time.DateTime), exp,
					cmp.Or(strings.Join(t.Allow, ","), "-"), cmp.Or(strings.Join(t.Policies, ","), "-"), quotaString(t.Quota))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	return ls
}

// tokenRemove is dsec token rm.
func (a *app) tokenRemove() *cobra.Command {
	return &cobra.Command{
		Use:   "rm ID...",
		Short: "Remove tokens: requests with them are refused at once",
		RunE: func(_ *cobra.Command, ids []string) error {
			if len(ids) == 0 {
				return usageError{errors.New("rm needs at least one token id (dsec token ls lists them)")}
			}
			s := auth.Open(a.cfg.Root)
			for _, id := range ids {
				if err := s.Remove(id); err != nil {
					return err
				}
				fmt.Fprintln(a.stdout, id)
			}
			return nil
		},
	}
}

// quotaString is a token's quota as token ls shows it.
func quotaString(q auth.Quota) string {
	var parts []string
	if q.Sandboxes > 0 {
		parts = append(parts, fmt.Sprintf("%d sandboxes", q.Sandboxes))
	}
	for _, f := range []struct {
		n    int64
		what string
	}{{q.Memory, "memory"}, {q.Disk, "disk"}, {q.SnapshotBytes, "snapshots"}} {
		if f.n > 0 {
			parts = append(parts, humanBytes(f.n)+" "+f.what)
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, ", ")
}

// certsCommand is dsec daemon certs.
func (a *app) certsCommand() *cobra.Command {
	var names []string
	cmd := &cobra.Command{
		Use:   "certs DIR",
		Short: "Make a CA, a certificate for the worker and one for a client, for a user without a PKI",
		Long: `Certs writes into DIR a CA (ca.pem, ca-key.pem), a certificate for the worker signed by it
for the host names and addresses --name gives (server.pem, server-key.pem), and a client
certificate (client.pem, client-key.pem) for a worker started with --tls-client-ca. Keys are
ECDSA P-256, mode 0600, valid for 825 days. Nothing is overwritten. The CA signs for the
names given alone (critical name constraints): a client that trusts it (NODE_EXTRA_CA_CERTS,
say) trusts it for the worker, and for no other site even should its key leak.

Give the worker server.pem and server-key.pem (--tls-cert, --tls-key, and for mutual TLS
--tls-client-ca ca.pem); give clients ca.pem (--tls-ca or DSEC_TLS_CA) and, for mutual TLS,
client.pem and client-key.pem (DSEC_CLIENT_CERT, DSEC_CLIENT_KEY). Keep ca-key.pem apart.

` + exitCodesHelp,
		Example: `  dsec daemon certs /etc/dsec/tls --name worker1.example --name 10.0.0.7
  dsec daemon --listen tcp://0.0.0.0:7443 --tls-cert /etc/dsec/tls/server.pem --tls-key /etc/dsec/tls/server-key.pem`,
		Args: exactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if len(names) == 0 {
				names = []string{"localhost", "127.0.0.1", "::1"}
				if h, err := os.Hostname(); err == nil && h != "localhost" {
					names = append([]string{h}, names...)
				}
			}
			if err := auth.MakeCerts(args[0], names); err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "%s: ca.pem, server.pem (for %v), client.pem and their keys\n", args[0], names)
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&names, "name", nil, "a host name or IP address clients reach the worker by (repeatable; default this host's name, localhost, 127.0.0.1, ::1)")
	return cmd
}
