//go:build !front

package main

import (
	"errors"
	"fmt"
	"os"
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
policies, squash, stopping the worker) is refused. The worker's unix socket takes no token:
its file permissions are its guard.

These commands act on this machine's root (--root), never on a --host worker.

` + exitCodesHelp,
		Example: `  dsec token create --scope sandboxes --ttl 24h   # print a token for one trainer
  dsec token create --e2b                         # an E2B_API_KEY for the E2B SDKs
  dsec token ls
  dsec token rm 3f2a9c1b`,
		Annotations: map[string]string{localAnnotation: "true"},
	}
	var scope string
	var ttl time.Duration
	var asJSON, e2bKey bool
	create := &cobra.Command{
		Use:   "create",
		Short: "Make a token and print it (the only time it is shown)",
		Args:  exactArgs(0),
		RunE: func(*cobra.Command, []string) error {
			prefix := auth.Prefix
			if e2bKey {
				prefix = auth.E2BPrefix
			}
			secret, t, err := auth.Open(a.cfg.Root).CreateWith(scope, ttl, prefix)
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
			fmt.Fprintln(tw, "ID\tSCOPE\tCREATED\tEXPIRES")
			now := time.Now()
			for _, t := range ts {
				exp := "never"
				if !t.Expires.IsZero() {
					exp = t.Expires.Local().Format(time.DateTime)
					if t.Expired(now) {
						exp += " (expired)"
					}
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", t.ID, t.Scope, t.Created.Local().Format(time.DateTime), exp)
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&lsJSON, "json", false, "print JSON")
	rm := &cobra.Command{
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
	cmd.AddCommand(create, ls, rm)
	return cmd
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
ECDSA P-256, mode 0600, valid for 825 days. Nothing is overwritten.

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
