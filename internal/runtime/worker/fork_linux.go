package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/durable"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/snap"
)

// Fork groups and leases: a fork is a pack-diff and a branch in one
// call, its snapshot and sandboxes a group; a lease holds groups, the
// sandboxes kept of them and their snapshots until it expires or is
// removed, and then the worker removes them (leaseLoop). Both live in
// <root>/forks.json, so that a lease outlives a worker's restart and
// expires all the same.

const maxLeaseTTL = 30 * 24 * time.Hour

var leaseIDRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^lease-[a-z0-9-]{1,64}$`) })

// forkBook is the worker's groups and leases.
type forkBook struct {
	mu     sync.Mutex
	path   string
	Groups map[string]*groupRec `json:"groups"`
	Leases map[string]*leaseRec `json:"leases"`
}

// groupRec is a group as the worker keeps it: Tag is its snapshot's
// store tag (Snapshot as its owner names it).
type groupRec struct {
	ID       string    `json:"id"`
	Owner    string    `json:"owner,omitempty"`
	Sandbox  string    `json:"sandbox"`
	Snapshot string    `json:"snapshot"`
	Tag      string    `json:"tag"`
	Lease    string    `json:"lease,omitempty"`
	Created  time.Time `json:"created"`
	Members  []string  `json:"members"`
	// IDs are the members' sandbox ids, by name: a sandbox of a
	// member's name made since (by another token, say) is none of it.
	IDs map[string]string `json:"ids,omitempty"`
}

// leaseRec is a lease as the worker keeps it: Kept are the sandboxes
// kept of its groups, Holds the store tags of their snapshots (with the
// names their owner gives them).
type leaseRec struct {
	ID      string            `json:"id"`
	Owner   string            `json:"owner,omitempty"`
	Created time.Time         `json:"created"`
	Expires time.Time         `json:"expires"`
	Kept    []string          `json:"kept,omitempty"`
	KeptIDs map[string]string `json:"kept_ids,omitempty"` // their sandbox ids, by name
	Holds   map[string]string `json:"holds,omitempty"`    // store tag -> its owner's name of it
}

// openForks reads root's groups and leases (none yet: empty).
func openForks(root string) (*forkBook, error) {
	b := &forkBook{path: filepath.Join(root, "forks.json"), Groups: map[string]*groupRec{}, Leases: map[string]*leaseRec{}}
	data, err := os.ReadFile(b.path)
	if errors.Is(err, os.ErrNotExist) {
		return b, nil
	}
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(data, b); err != nil {
		return nil, fmt.Errorf("%s: %w", b.path, err)
	}
	if b.Groups == nil {
		b.Groups = map[string]*groupRec{}
	}
	if b.Leases == nil {
		b.Leases = map[string]*leaseRec{}
	}
	return b, nil
}

// save writes the book; b.mu is held.
func (b *forkBook) save() error {
	data, err := json.Marshal(b)
	if err != nil {
		return err
	}
	return durable.WriteFile(b.path, data, 0o600)
}

func leaseTTL(ttl int) (time.Duration, error) {
	d := time.Duration(ttl) * time.Second
	if ttl <= 0 || d > maxLeaseTTL {
		return 0, fmt.Errorf("lease ttl %ds: give 1 to %d seconds: %w", ttl, int(maxLeaseTTL.Seconds()), errdefs.ErrInvalidArgument)
	}
	return d, nil
}

// lease is the caller's lease id, live.
func (w *worker) lease(ctx context.Context, id string) (*leaseRec, error) {
	l := w.forks.Leases[id]
	if l == nil || !mayUse(ctx, l.Owner) || !time.Now().Before(l.Expires) {
		return nil, fmt.Errorf("no lease %s (dsec lease ls lists them; an expired one is gone): %w", id, errdefs.ErrNotFound)
	}
	return l, nil
}

func (w *worker) createLease(r *http.Request, req api.LeaseRequest) (created[api.Lease], error) {
	d, err := leaseTTL(req.TTL)
	if err != nil {
		return created[api.Lease]{}, err
	}
	b := w.forks
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	l := &leaseRec{ID: req.ID, Owner: ownerOf(r.Context()), Created: now, Expires: now.Add(d)}
	switch {
	case l.ID == "":
		l.ID = runtime.RandomName("lease-")
	case !leaseIDRE().MatchString(l.ID):
		return created[api.Lease]{}, fmt.Errorf("bad lease id %q: use lease- and up to 64 lowercase letters, digits and '-': %w", l.ID, errdefs.ErrInvalidArgument)
	case b.Leases[l.ID] != nil:
		return created[api.Lease]{}, fmt.Errorf("lease %s exists already: %w", l.ID, errdefs.ErrAlreadyExists)
	}
	b.Leases[l.ID] = l
	if err := b.save(); err != nil {
		delete(b.Leases, l.ID)
		return created[api.Lease]{}, err
	}
	return created[api.Lease]{w.describeLease(l)}, nil
}

func (w *worker) renewLease(r *http.Request, req api.LeaseRequest) (api.Lease, error) {
	d, err := leaseTTL(req.TTL)
	if err != nil {
		return api.Lease{}, err
	}
	b := w.forks
	b.mu.Lock()
	defer b.mu.Unlock()
	l, err := w.lease(r.Context(), r.PathValue("id"))
	if err != nil {
		return api.Lease{}, err
	}
	l.Expires = time.Now().Add(d)
	if err := b.save(); err != nil {
		return api.Lease{}, err
	}
	return w.describeLease(l), nil
}

func (w *worker) showLease(r *http.Request, _ none) (api.Lease, error) {
	b := w.forks
	b.mu.Lock()
	defer b.mu.Unlock()
	l, err := w.lease(r.Context(), r.PathValue("id"))
	if err != nil {
		return api.Lease{}, err
	}
	return w.describeLease(l), nil
}

func (w *worker) listLeases(r *http.Request, _ none) ([]api.Lease, error) {
	b := w.forks
	b.mu.Lock()
	defer b.mu.Unlock()
	out := []api.Lease{}
	for _, l := range b.Leases {
		if mayUse(r.Context(), l.Owner) && time.Now().Before(l.Expires) {
			out = append(out, w.describeLease(l))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

func (w *worker) removeLease(r *http.Request, _ none) (api.Released, error) {
	b := w.forks
	b.mu.Lock()
	l, err := w.lease(r.Context(), r.PathValue("id"))
	b.mu.Unlock()
	if err != nil {
		return api.Released{}, err
	}
	return w.releaseLease(context.WithoutCancel(r.Context()), l.ID), nil
}

// holders are the groups and leases that hold the snapshot store tag.
func (b *forkBook) holders(tag string) []string {
	if b == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, g := range b.Groups {
		if g.Tag == tag {
			out = append(out, "group "+g.ID)
			if g.Lease != "" {
				out = append(out, "lease "+g.Lease)
			}
		}
	}
	for _, l := range b.Leases {
		if _, ok := l.Holds[tag]; ok {
			out = append(out, "lease "+l.ID)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// describeLease is l as its owner sees it; b.mu is held.
func (w *worker) describeLease(l *leaseRec) api.Lease {
	out := api.Lease{ID: l.ID, Owner: l.Owner, Created: l.Created, Expires: l.Expires, Groups: []string{}, Kept: slices.Clone(l.Kept), Holds: []string{}}
	if out.Kept == nil {
		out.Kept = []string{}
	}
	for _, g := range w.forks.Groups {
		if g.Lease == l.ID {
			out.Groups = append(out.Groups, g.ID)
			out.Holds = append(out.Holds, g.Snapshot)
		}
	}
	for _, name := range l.Holds {
		if !slices.Contains(out.Holds, name) {
			out.Holds = append(out.Holds, name)
		}
	}
	slices.Sort(out.Groups)
	slices.Sort(out.Holds)
	return out
}

// releaseLease ends lease id: its groups' members and its kept
// sandboxes removed, the snapshots it holds untagged unless something
// else stands on them.
func (w *worker) releaseLease(ctx context.Context, id string) api.Released {
	// The lease and its groups leave the book at once: a keep or a fork
	// meanwhile finds neither.
	b := w.forks
	b.mu.Lock()
	l := b.Leases[id]
	if l == nil {
		b.mu.Unlock()
		return api.Released{Sandboxes: []string{}, Snapshots: []string{}}
	}
	delete(b.Leases, id)
	var groups []*groupRec
	for gid, g := range b.Groups {
		if g.Lease == id {
			groups = append(groups, g)
			delete(b.Groups, gid)
		}
	}
	kept, keptIDs, holds := slices.Clone(l.Kept), maps.Clone(l.KeptIDs), maps.Clone(l.Holds)
	if err := b.save(); err != nil {
		w.log.Error("cannot record a lease's end", "lease", id, "err", err)
	}
	b.mu.Unlock()
	out := api.Released{Sandboxes: []string{}, Snapshots: []string{}}
	for _, g := range groups {
		r := w.releaseGroup(ctx, g, "")
		out.Sandboxes = append(out.Sandboxes, r.Sandboxes...)
		out.Snapshots = append(out.Snapshots, r.Snapshots...)
		out.Kept = append(out.Kept, r.Kept...)
	}
	for _, name := range kept {
		if w.removeHeld(name, keptIDs[name]) {
			out.Sandboxes = append(out.Sandboxes, name)
		}
	}
	for tag, name := range holds {
		if w.untag(ctx, tag) {
			out.Snapshots = append(out.Snapshots, name)
		} else {
			out.Kept = append(out.Kept, name)
		}
	}
	w.log.Info("a lease ended", "lease", id, "removed", out.Sandboxes, "untagged", out.Snapshots)
	return out
}

// leaseLoop ends the leases that expire, every second, until ctx ends.
func (w *worker) leaseLoop(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		w.expireLeases(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (w *worker) expireLeases(ctx context.Context) {
	b := w.forks
	b.mu.Lock()
	var ids []string
	for id, l := range b.Leases {
		if !time.Now().Before(l.Expires) {
			ids = append(ids, id)
		}
	}
	var empty []*groupRec // every member removed by other means
	for _, g := range b.Groups {
		if !slices.ContainsFunc(g.Members, func(name string) bool { return w.holds(name, g.IDs[name]) }) {
			empty = append(empty, g)
		}
	}
	b.mu.Unlock()
	for _, id := range ids {
		w.releaseLease(ctx, id)
	}
	for _, g := range empty {
		w.releaseGroup(ctx, g, "")
	}
}

// holds says whether the sandbox name is the worker's, made or being
// made, and is the one of id ("": any).
func (w *worker) holds(name, id string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.sandboxes[name]
	return e != nil && (id == "" || e.sb == nil || e.sb.ID == id)
}

// idOf is the id of the worker's sandbox name ("": none).
func (w *worker) idOf(name string) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e := w.sandboxes[name]; e != nil && e.sb != nil {
		return e.sb.ID
	}
	return ""
}

// removeHeld removes the sandbox name (of id: a sandbox of its name made
// since is another's) a lease or group held, and says whether there was
// one to remove.
func (w *worker) removeHeld(name, id string) bool {
	w.mu.Lock()
	if e := w.sandboxes[name]; e == nil || e.sb == nil || id != "" && e.sb.ID != id {
		w.mu.Unlock()
		return false
	}
	e := w.going(name)
	w.mu.Unlock()
	if e == nil {
		return false
	}
	w.drop(name, e)
	return true
}

// untag untags the snapshot store tag unless something stands on it,
// and says whether it did (or it was gone already).
func (w *worker) untag(ctx context.Context, tag string) bool {
	users, err := runtime.SnapUsers(w.cfg.Root)
	if err != nil {
		return false
	}
	_, err = snap.Remove(ctx, w.host.Store, tag, users, false)
	return err == nil || errdefs.IsNotFound(err)
}

// fork packs the sandbox and starts N sandboxes on the snapshot, a
// group held by a lease (or until it is removed).
func (w *worker) fork(r *http.Request, req api.ForkRequest) (created[api.Group], error) {
	if req.N < 1 || req.N > maxBranches {
		return created[api.Group]{}, fmt.Errorf("fork count %d: give 1 to %d: %w", req.N, maxBranches, errdefs.ErrInvalidArgument)
	}
	if req.Lease != "" && req.TTL != 0 {
		return created[api.Group]{}, fmt.Errorf("a fork names a lease or gives a ttl for a new one, not both: %w", errdefs.ErrInvalidArgument)
	}
	ctx := r.Context()
	_, err := w.get(r)
	if err != nil {
		return created[api.Group]{}, err
	}
	name := r.PathValue("name")
	b := w.forks
	leaseID := req.Lease
	made := ""
	switch {
	case req.TTL != 0:
		l, err := w.createLease(r, api.LeaseRequest{TTL: req.TTL})
		if err != nil {
			return created[api.Group]{}, err
		}
		leaseID, made = l.v.ID, l.v.ID
	case leaseID != "":
		b.mu.Lock()
		_, err := w.lease(ctx, leaseID)
		b.mu.Unlock()
		if err != nil {
			return created[api.Group]{}, err
		}
	}
	fail := func(err error) (created[api.Group], error) {
		if made != "" {
			w.releaseLease(context.WithoutCancel(ctx), made)
		}
		return created[api.Group]{}, err
	}
	tag := req.Tag
	if tag == "" {
		if tag, err = w.nextForkTag(ctx, name); err != nil {
			return fail(err)
		}
	}
	snapshot, err := w.packDiff(r, api.PackRequest{Tag: tag, Memory: req.Memory})
	if err != nil {
		return fail(err)
	}
	storeTag, _ := w.scopeOf(ctx).newTag(tag)
	branches, err := w.branch(r, api.BranchRequest{Snapshot: tag, N: req.N, NamePrefix: req.NamePrefix, Like: name})
	if err != nil {
		w.untag(context.WithoutCancel(ctx), storeTag.String())
		return fail(err)
	}
	g := &groupRec{ID: runtime.RandomName("group-"), Owner: ownerOf(ctx), Sandbox: name, Snapshot: tag, Tag: storeTag.String(), Lease: leaseID,
		Created: time.Now(), Members: []string{}, IDs: map[string]string{}}
	for _, s := range branches.v {
		g.Members = append(g.Members, s.Name)
		g.IDs[s.Name] = w.idOf(s.Name)
	}
	b.mu.Lock()
	if _, err := w.lease(ctx, leaseID); leaseID != "" && err != nil { // it ended meanwhile
		b.mu.Unlock()
		w.releaseGroup(context.WithoutCancel(ctx), g, "")
		return fail(fmt.Errorf("lease %s ended while the fork was made: nothing is left of it: %w", leaseID, errdefs.ErrNotFound))
	}
	b.Groups[g.ID] = g
	err = b.save()
	b.mu.Unlock()
	if err != nil {
		return fail(err)
	}
	w.log.Info("forked", "sandbox", name, "group", g.ID, "snapshot", snapshot.v.Name, "n", req.N, "lease", leaseID)
	return created[api.Group]{w.describeGroup(g)}, nil
}

// nextForkTag is fork-NAME:K, K the first free step of the caller's.
func (w *worker) nextForkTag(ctx context.Context, name string) (string, error) {
	sc := w.scopeOf(ctx)
	for k := 1; k < 1<<20; k++ {
		tag := fmt.Sprintf("fork-%s:%d", name, k)
		ref, err := sc.newTag(tag)
		if err != nil {
			return "", err
		}
		if _, err := layer.Resolve(ctx, w.host.Store, ref.String()); errdefs.IsNotFound(err) {
			return tag, nil
		}
	}
	return "", fmt.Errorf("no free fork tag for %s: give --tag: %w", name, errdefs.ErrResourceExhausted)
}

// describeGroup is g with its members as they are now.
func (w *worker) describeGroup(g *groupRec) api.Group {
	out := api.Group{ID: g.ID, Owner: g.Owner, Sandbox: g.Sandbox, Snapshot: g.Snapshot, Lease: g.Lease, Created: g.Created, Members: []api.Member{}}
	for _, name := range g.Members {
		m := api.Member{Name: name, Status: "gone"}
		w.mu.Lock()
		e := w.sandboxes[name]
		w.mu.Unlock()
		if e != nil && e.sb != nil && e.gone == nil && (g.IDs[name] == "" || e.sb.ID == g.IDs[name]) {
			m.Status = w.describeAs(e.sb, false).Status
			m.LastExec, m.Execs = e.sb.LastExec()
		}
		out.Members = append(out.Members, m)
	}
	return out
}

// groupOf is the caller's group r names.
func (w *worker) groupOf(r *http.Request) (*groupRec, error) {
	w.forks.mu.Lock()
	defer w.forks.mu.Unlock()
	return w.group(r.Context(), r.PathValue("id"))
}

// group is the caller's group id; b.mu is held.
func (w *worker) group(ctx context.Context, id string) (*groupRec, error) {
	g := w.forks.Groups[id]
	if g == nil || !mayUse(ctx, g.Owner) {
		return nil, fmt.Errorf("no group %s (dsec group ls lists them): %w", id, errdefs.ErrNotFound)
	}
	return g, nil
}

func (w *worker) listGroups(r *http.Request, _ none) ([]api.Group, error) {
	b := w.forks
	b.mu.Lock()
	var gs []*groupRec
	for _, g := range b.Groups {
		if mayUse(r.Context(), g.Owner) {
			gs = append(gs, g)
		}
	}
	b.mu.Unlock()
	out := []api.Group{}
	for _, g := range gs {
		out = append(out, w.describeGroup(g))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

func (w *worker) showGroup(r *http.Request, _ none) (api.Group, error) {
	g, err := w.groupOf(r)
	if err != nil {
		return api.Group{}, err
	}
	return w.describeGroup(g), nil
}

func (w *worker) removeGroup(r *http.Request, _ none) (api.Released, error) {
	g, err := w.groupOf(r)
	if err != nil {
		return api.Released{}, err
	}
	return w.releaseGroup(context.WithoutCancel(r.Context()), g, ""), nil
}

func (w *worker) keepMember(r *http.Request, req api.KeepRequest) (api.Released, error) {
	g, err := w.groupOf(r)
	if err != nil {
		return api.Released{}, err
	}
	if !slices.Contains(g.Members, req.Member) {
		return api.Released{}, fmt.Errorf("group %s has no member %s (its members: %v): %w", g.ID, req.Member, g.Members, errdefs.ErrInvalidArgument)
	}
	return w.releaseGroup(context.WithoutCancel(r.Context()), g, req.Member), nil
}

// releaseGroup removes g's members but keep (""; none), and the group;
// its snapshot is untagged unless something stands on it. The member
// kept, and then the snapshot it stands on, are held by g's lease.
func (w *worker) releaseGroup(ctx context.Context, g *groupRec, keep string) api.Released {
	out := api.Released{Sandboxes: []string{}, Snapshots: []string{}}
	for _, name := range g.Members {
		if name != keep && w.removeHeld(name, g.IDs[name]) {
			out.Sandboxes = append(out.Sandboxes, name)
		}
	}
	b := w.forks
	b.mu.Lock()
	l := b.Leases[g.Lease]
	if keep != "" && l != nil {
		l.Kept = append(l.Kept, keep)
		if l.KeptIDs == nil {
			l.KeptIDs = map[string]string{}
		}
		l.KeptIDs[keep] = g.IDs[keep]
	}
	b.mu.Unlock()
	switch {
	case keep == "" && w.untag(ctx, g.Tag):
		out.Snapshots = append(out.Snapshots, g.Snapshot)
	case l != nil:
		b.mu.Lock()
		if l.Holds == nil {
			l.Holds = map[string]string{}
		}
		l.Holds[g.Tag] = g.Snapshot
		b.mu.Unlock()
		out.Kept = append(out.Kept, g.Snapshot)
	default:
		out.Kept = append(out.Kept, g.Snapshot)
	}
	if keep != "" {
		out.Kept = append(out.Kept, keep)
	}
	b.mu.Lock()
	delete(b.Groups, g.ID)
	if err := b.save(); err != nil {
		w.log.Error("cannot record a group's end", "group", g.ID, "err", err)
	}
	b.mu.Unlock()
	return out
}
