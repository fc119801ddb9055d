package e2b

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// Snapshots of E2B sandboxes: pack-diff, fork, and the snapshots' routes.

// snapshotTag is the NAME:STEP the next snapshot of rec gets.
func snapshotTag(name string, step int) string { return name + ":" + strconv.Itoa(step) }

// packDiff snapshots sandbox id's files under name (the sandbox's id by
// default) and counts it in the record.
func (s *Server) packDiff(ctx context.Context, c *sdk.Client, sb api.Sandbox, name string) (string, error) {
	if err := s.ensureRecord(sb); err != nil {
		return "", err
	}
	rec, _ := s.records.get(sb.Name)
	if sb.Status == api.StatusStopped || sb.Status == api.StatusDead {
		return "", fmt.Errorf("sandbox %s is paused without its memory (stopped): connect to it first: %w", sb.Name, errdefs.ErrFailedPrecondition)
	}
	tag := snapshotTag(cmp.Or(name, "e2b-"+sb.Name), rec.Snapshots+1)
	if _, err := c.Sandbox(sb.Name).PackDiff(ctx, api.PackRequest{Tag: tag}); err != nil {
		if name == "" && sb.Status == api.StatusRunning && errdefs.IsFailedPrecondition(err) && strings.Contains(err.Error(), "nothing changed in sandbox") {
			if last := lastSnapshot(ctx, c, sb); last != "" {
				return last, nil // that one holds this state (a second fork)
			}
		}
		return "", err
	}
	return tag, s.records.update(sb.Name, func(r *record) { r.Snapshots++ })
}

// lastSnapshot is the newest snapshot the caller sees of sb ("": none).
func lastSnapshot(ctx context.Context, c *sdk.Client, sb api.Sandbox) string {
	snaps, err := c.Snapshots(ctx)
	if err != nil {
		return ""
	}
	var last api.SnapshotNode
	for _, n := range snaps {
		// (Not an earlier sandbox's of its name: times in whole seconds.)
		if n.Sandbox == sb.Name && !n.Created.Before(sb.Created.Truncate(time.Second)) && n.Created.After(last.Created) {
			last = n
		}
	}
	return last.Name
}

// fork makes count sandboxes on a snapshot of the sandbox's files
// (dsec's branch): each its own upper over the same layers. Container
// snapshots hold files, not processes: the forks start fresh ones.
func (s *Server) fork(rw http.ResponseWriter, r *http.Request, c *sdk.Client, who caller) error {
	var req struct {
		Count   *int   `json:"count"`
		Timeout *int64 `json:"timeout"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	n := 1
	if req.Count != nil {
		n = *req.Count
	}
	if n < 1 || n > 100 {
		return fmt.Errorf("bad count %d: give 1 to 100: %w", n, errdefs.ErrInvalidArgument)
	}
	d, err := timeoutOf(req.Timeout, defaultTimeout)
	if err != nil {
		return err
	}
	src, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	from := s.recordOf(src)
	prefix := newID()
	now := time.Now().UTC()
	var recs []record
	for i := range n {
		rec := record{ID: fmt.Sprintf("%s-%d", prefix, i+1), Owner: who.id, Template: from.Template, Metadata: from.Metadata, EnvVars: from.EnvVars,
			Started: now, EndAt: now.Add(d), OnTimeout: from.OnTimeout, PauseMemory: from.PauseMemory, AutoResume: from.AutoResume, NextPID: 1}
		if err := s.records.put(rec); err != nil {
			return err
		}
		recs = append(recs, rec)
	}
	made, err := s.forkGroup(r.Context(), c, src, n, prefix)
	if err != nil {
		for _, rec := range recs {
			s.records.remove(rec.ID)
		}
		return err
	}
	type result struct {
		Sandbox sandboxAnswer `json:"sandbox"`
	}
	out := make([]result, n)
	for i, sb := range made {
		if err := s.records.update(sb.Name, func(r *record) { r.Sandbox = sb.Info.ID }); err != nil {
			return err
		}
		rec, _ := s.records.get(sb.Name)
		out[i].Sandbox = s.answer(r.Context(), rec)
	}
	writeJSON(rw, http.StatusCreated, out)
	return nil
}

// forkGroup forks src into n sandboxes named prefix-1 ...: a fork group
// of its worker (the snapshot goes once they all do), or, where nothing
// changed since src's last snapshot, a branch of that one.
func (s *Server) forkGroup(ctx context.Context, c *sdk.Client, src api.Sandbox, n int, prefix string) ([]*sdk.Sandbox, error) {
	if err := s.ensureRecord(src); err != nil {
		return nil, err
	}
	if src.Status == api.StatusStopped || src.Status == api.StatusDead {
		return nil, fmt.Errorf("sandbox %s is paused without its memory (stopped): connect to it first: %w", src.Name, errdefs.ErrFailedPrecondition)
	}
	rec, _ := s.records.get(src.Name)
	tag := snapshotTag("e2b-"+src.Name, rec.Snapshots+1)
	g, err := c.Sandbox(src.Name).Fork(ctx, api.ForkRequest{N: n, NamePrefix: prefix, Tag: tag})
	if err == nil {
		if err := s.records.update(src.Name, func(r *record) { r.Snapshots++ }); err != nil {
			return nil, err
		}
		out := make([]*sdk.Sandbox, len(g.Members))
		for i, m := range g.Members {
			out[i] = c.Sandbox(m.Name)
			info, err := out[i].Inspect(ctx)
			if err != nil {
				return nil, err
			}
			out[i].Info = info
		}
		return out, nil
	}
	if src.Status != api.StatusRunning || !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "nothing changed in sandbox") {
		return nil, err
	}
	last := lastSnapshot(ctx, c, src) // that one holds this state (a second fork)
	if last == "" {
		return nil, err
	}
	return c.Branch(ctx, api.BranchRequest{Snapshot: last, N: n, NamePrefix: prefix, Like: src.Name})
}

// grade is dsec's extension of E2B's API: POST /sandboxes/{id}/grade
// grades the sandbox in a fresh one, as dsec grade does (its body an
// api.GradeRequest, its answer an api.Grade).
func (s *Server) grade(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	var req api.GradeRequest
	if err := decode(r, &req); err != nil {
		return err
	}
	src, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	g, err := c.Sandbox(src.Name).Grade(r.Context(), req)
	if err != nil {
		return err
	}
	writeJSON(rw, http.StatusOK, g)
	return nil
}

// snapshotInfo is SnapshotInfo: its id is the dsec snapshot's NAME:STEP,
// which Sandbox.create takes as a template ID.
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func (s *Server) snapshot(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	var req struct {
		Name string `json:"name"`
	}
	if err := decode(r, &req); err != nil {
		return err
	}
	if req.Name != "" && api.ValidName(req.Name) != nil {
		return fmt.Errorf("bad snapshot name %q: use up to 63 letters, digits, '_', '.' and '-': %w", req.Name, errdefs.ErrInvalidArgument)
	}
	sb, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	tag, err := s.packDiff(r.Context(), c, sb, req.Name)
	if err != nil {
		return err
	}
	writeJSON(rw, http.StatusCreated, snapshotInfo{SnapshotID: tag, Names: []string{tag}})
	return nil
}

func (s *Server) snapshots(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	q := r.URL.Query()
	nodes, err := c.Snapshots(r.Context())
	if err != nil {
		return err
	}
	out := []snapshotInfo{}
	for _, n := range nodes {
		if sid := q.Get("sandboxID"); sid != "" && n.Sandbox != sid {
			continue
		}
		if name := q.Get("name"); name != "" && !strings.HasPrefix(n.Name, name+":") && n.Name != name {
			continue
		}
		out = append(out, snapshotInfo{SnapshotID: n.Name, Names: []string{n.Name}})
	}
	if tok := q.Get("nextToken"); tok != "" {
		i := slices.IndexFunc(out, func(si snapshotInfo) bool { return si.SnapshotID == tok })
		if i < 0 {
			return fmt.Errorf("bad nextToken %q: list from the start: %w", tok, errdefs.ErrInvalidArgument)
		}
		out = out[i+1:]
	}
	limit := 100
	if l := q.Get("limit"); l != "" {
		var err error
		if limit, err = strconv.Atoi(l); err != nil || limit < 1 || limit > 100 {
			return fmt.Errorf("bad limit %q: give 1 to 100: %w", l, errdefs.ErrInvalidArgument)
		}
	}
	if len(out) > limit {
		out = out[:limit]
		rw.Header().Set("X-Next-Token", out[limit-1].SnapshotID)
	}
	writeJSON(rw, http.StatusOK, out)
	return nil
}

func (s *Server) deleteSnapshot(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	id := r.PathValue("id")
	if err := c.RemoveSnapshot(r.Context(), id, false); err != nil {
		return err
	}
	rw.WriteHeader(http.StatusNoContent)
	return nil
}
