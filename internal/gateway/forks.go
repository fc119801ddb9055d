package gateway

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// Fork groups and leases through a gateway: a group lives on the worker
// of the sandbox forked; a lease the gateway makes is made, of one id,
// on every worker up (and on a worker that lacks it when a fork there
// names it), renewed and ended on every worker that has it. A lease a
// fork made (its ttl) lives on that fork's worker.

// fork forks a sandbox on its worker: the members' names claimed for
// the fleet first, the tenant's quota held as a create's.
func (g *Gateway) fork(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	var req api.ForkRequest
	if err := json.Unmarshal(body, &req); err != nil {
		fail(rw, fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if req.N < 1 || req.N > 1024 {
		fail(rw, fmt.Errorf("fork count %d: give 1 to 1024: %w", req.N, errdefs.ErrInvalidArgument))
		return
	}
	name := r.PathValue("name")
	n := g.holderNamed(rw, r, name)
	if n == nil {
		return
	}
	if req.Lease != "" {
		if err := g.leaseOn(r, n, req.Lease); err != nil {
			fail(rw, err)
			return
		}
	}
	// The members' names, the fleet's: a prefix of its own unless given.
	auto := req.NamePrefix == ""
	var c *claimed
	for try := 0; ; try++ {
		if auto {
			var b [3]byte
			rand.Read(b[:])
			req.NamePrefix = "fork-" + name + "-" + hex.EncodeToString(b[:])
		}
		names := make([]string, req.N)
		for i := range names {
			names[i] = fmt.Sprintf("%s-%d", req.NamePrefix, i+1)
		}
		var err error
		if c, err = g.claim(r.Context(), names); err == nil {
			break
		} else if !auto || !errdefs.IsAlreadyExists(err) || try > 16 {
			fail(rw, err)
			return
		}
	}
	var made []string
	defer func() { c.done(func(name string) bool { return slices.Contains(made, name) }) }()
	body, _ = json.Marshal(req)
	resp, n, settle, err := g.createOne(r.Context(), tokenOf(r), r.URL.RequestURI(), body, demandOf(api.SandboxSpec{}, req.N), func(o *node) bool { return o == n })
	if err != nil {
		fail(rw, err)
		return
	}
	defer resp.Body.Close()
	defer settle("")
	if resp.StatusCode != http.StatusCreated {
		relay(rw, resp)
		return
	}
	var grp api.Group
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&grp); err != nil {
		fail(rw, fmt.Errorf("worker %s's answer to a fork: %v: %w", n.URL, err, errdefs.ErrUnavailable))
		return
	}
	for _, m := range grp.Members {
		made = append(made, m.Name)
		g.made(n, api.Sandbox{SandboxSpec: api.SandboxSpec{Name: m.Name}, Status: m.Status, Owner: grp.Owner, Node: n.URL})
	}
	answer(rw, http.StatusCreated, grp)
}

// leaseOn makes sure n has the caller's lease id, made there of what
// another worker says of it when n lacks it.
func (g *Gateway) leaseOn(r *http.Request, n *node, id string) error {
	path := "/" + api.Version + "/leases/" + id
	answers := g.toEach(r, http.MethodGet, path, nil, nil)
	var found *api.Lease
	for _, a := range answers {
		if a.failure() != nil {
			continue
		}
		if a.n == n {
			return nil
		}
		var l api.Lease
		if json.Unmarshal(a.body, &l) == nil {
			found = &l
		}
	}
	if found == nil {
		return fmt.Errorf("no lease %s (dsec lease ls lists them; an expired one is gone): %w", id, errdefs.ErrNotFound)
	}
	ttl := int(time.Until(found.Expires).Round(time.Second).Seconds())
	if ttl < 1 {
		return fmt.Errorf("no lease %s (dsec lease ls lists them; an expired one is gone): %w", id, errdefs.ErrNotFound)
	}
	b, _ := json.Marshal(api.LeaseRequest{ID: id, TTL: ttl})
	a := g.sendTo(r, n, tokenOf(r), http.MethodPost, "/"+api.Version+"/leases", func(*node) []byte { return b })
	if err := a.failure(); err != nil && !errdefs.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// createLease makes a lease of one id on every worker up.
func (g *Gateway) createLease(rw http.ResponseWriter, r *http.Request) {
	body, ok := readBody(rw, r)
	if !ok {
		return
	}
	var req api.LeaseRequest
	if err := json.Unmarshal(body, &req); err != nil {
		fail(rw, fmt.Errorf("bad request body: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if req.ID == "" {
		var b [6]byte
		rand.Read(b[:])
		req.ID = "lease-" + hex.EncodeToString(b[:])
	}
	body, _ = json.Marshal(req)
	answers := g.toEach(r, http.MethodPost, r.URL.RequestURI(), func(*node) []byte { return body }, nil)
	written(rw, "make lease "+req.ID, answers, func(a answerOf) {
		rw.Header().Set("Content-Type", "application/json")
		rw.WriteHeader(a.status)
		rw.Write(a.body)
	})
}

// leases is every worker's list of the caller's leases, each once, what
// they hold joined.
func (g *Gateway) leases(rw http.ResponseWriter, r *http.Request) {
	var out []api.Lease
	if !merged(g, rw, r, &out, func(l api.Lease) string { return l.ID }, joinLease) {
		return
	}
	answer(rw, http.StatusOK, out)
}

func joinLease(into *api.Lease, more api.Lease) {
	into.Groups = append(into.Groups, more.Groups...)
	into.Kept = append(into.Kept, more.Kept...)
	into.Holds = append(into.Holds, more.Holds...)
	if more.Expires.After(into.Expires) {
		into.Expires = more.Expires
	}
}

// toHaving sends r to every worker up that has what it names (a lease:
// each that has it; a group: its worker) and answers: what the one
// answered, or for several (a lease's renewal or end) the first's with
// what each released joined.
func (g *Gateway) toHaving(what string) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		id := r.PathValue("id")
		var body []byte
		if r.Method != http.MethodGet {
			var ok bool
			if body, ok = readBody(rw, r); !ok {
				return
			}
		}
		have := g.toEach(r, http.MethodGet, "/"+api.Version+"/"+what+"s/"+id, nil, nil)
		var nodes []*node
		for _, a := range have {
			if a.failure() == nil {
				nodes = append(nodes, a.n)
			}
		}
		if len(nodes) == 0 {
			fail(rw, fmt.Errorf("no %s %s (dsec %s ls lists them): %w", what, id, what, errdefs.ErrNotFound))
			return
		}
		if r.Method == http.MethodGet {
			i := slices.IndexFunc(have, func(a answerOf) bool { return a.n == nodes[0] })
			rw.Header().Set("Content-Type", "application/json")
			rw.WriteHeader(have[i].status)
			rw.Write(have[i].body)
			return
		}
		answers := g.toEach(r, r.Method, r.URL.RequestURI(), func(*node) []byte { return body }, func(n *node) bool { return slices.Contains(nodes, n) })
		var rel api.Released
		joined := false
		for _, a := range answers {
			var one api.Released
			if a.failure() == nil && json.Unmarshal(a.body, &one) == nil && one.Sandboxes != nil {
				rel.Sandboxes = append(rel.Sandboxes, one.Sandboxes...)
				rel.Snapshots = append(rel.Snapshots, one.Snapshots...)
				rel.Kept = append(rel.Kept, one.Kept...)
				joined = true
				for _, name := range one.Sandboxes {
					g.forget(a.n, name)
				}
			}
		}
		written(rw, r.Method+" "+what+" "+id, answers, func(a answerOf) {
			if joined {
				answer(rw, a.status, rel)
				return
			}
			rw.Header().Set("Content-Type", "application/json")
			rw.WriteHeader(a.status)
			rw.Write(a.body)
		})
	}
}

// groups is every worker's list of the caller's fork groups.
func (g *Gateway) groups(rw http.ResponseWriter, r *http.Request) {
	var out []api.Group
	if !merged(g, rw, r, &out, func(x api.Group) string { return x.ID }, nil) {
		return
	}
	slices.SortStableFunc(out, func(a, b api.Group) int { return a.Created.Compare(b.Created) })
	answer(rw, http.StatusOK, out)
}
