package sdk

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"

	"github.com/dsec-project/dsec/api"
)

// A sandbox's files: one at a time, and copies of trees in and out.

// WriteFile writes r to the file p in the sandbox (atomically: readers
// see the old file or the whole new one).
func (s *Sandbox) WriteFile(ctx context.Context, p string, r io.Reader, mode os.FileMode) error {
	q := url.Values{"path": {p}, "mode": {"0" + strconv.FormatUint(uint64(mode.Perm()), 8)}}
	return s.c.do(ctx, "PUT", s.path("/files?"+q.Encode()), r, nil)
}

// ReadFile copies the file p of the sandbox to w.
func (s *Sandbox) ReadFile(ctx context.Context, p string, w io.Writer) error {
	resp, err := s.c.send(ctx, "GET", s.path("/files?"+url.Values{"path": {p}}.Encode()), nil)
	if err != nil {
		return err
	}
	defer closeBody(resp.Body)
	_, err = io.Copy(w, resp.Body)
	return err
}

// Stat describes the path p in the sandbox; follow: a symlink at p is
// followed (inside the sandbox's root). errdefs.ErrNotFound if there
// is nothing at p.
func (s *Sandbox) Stat(ctx context.Context, p string, follow bool) (api.PathStat, error) {
	var st api.PathStat
	return st, s.c.do(ctx, "GET", s.path("/stat?"+archiveQuery(p, follow, "").Encode()), nil, &st)
}

// ListDir lists the directory p of the sandbox, depth levels down (0:
// its entries only).
func (s *Sandbox) ListDir(ctx context.Context, p string, depth int) ([]api.DirEntry, error) {
	q := url.Values{"path": {p}}
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	var out []api.DirEntry
	return out, s.c.do(ctx, "GET", s.path("/dir?"+q.Encode()), nil, &out)
}

// MakeDir makes the directory p (parents: its missing parents too);
// errdefs.ErrAlreadyExists if something is there.
func (s *Sandbox) MakeDir(ctx context.Context, p string, parents bool) (api.PathStat, error) {
	q := url.Values{"path": {p}}
	if parents {
		q.Set("parents", "1")
	}
	var st api.PathStat
	return st, s.c.do(ctx, "POST", s.path("/mkdir?"+q.Encode()), nil, &st)
}

// Rename moves p to to in the sandbox and describes it there.
func (s *Sandbox) Rename(ctx context.Context, p, to string) (api.PathStat, error) {
	var st api.PathStat
	return st, s.c.do(ctx, "POST", s.path("/rename?"+url.Values{"path": {p}, "to": {to}}.Encode()), nil, &st)
}

// RemovePath removes p in the sandbox: a file or link, an empty
// directory, or with recursive a whole tree.
func (s *Sandbox) RemovePath(ctx context.Context, p string, recursive bool) error {
	q := url.Values{"path": {p}}
	if recursive {
		q.Set("recursive", "1")
	}
	return s.c.do(ctx, "DELETE", s.path("/files?"+q.Encode()), nil, nil)
}

// CopyFromOptions shape the archive CopyFrom reads.
type CopyFromOptions struct {
	// Name is the archive's top entry ("." for a directory's entries);
	// empty: p's base name.
	Name string
	// Follow follows a symlink at p itself.
	Follow bool
}

// CopyFrom reads the tree at p in the sandbox as a tar stream. The
// stream's Read fails (never a short tar that looks whole) if the
// worker fails while it sends it.
func (s *Sandbox) CopyFrom(ctx context.Context, p string, o CopyFromOptions) (*CopyStream, api.PathStat, error) {
	resp, err := s.c.send(ctx, "GET", s.path("/archive?"+archiveQuery(p, o.Follow, o.Name).Encode()), nil)
	if err != nil {
		return nil, api.PathStat{}, err
	}
	var st api.PathStat
	if err := json.Unmarshal([]byte(resp.Header.Get(api.HeaderStat)), &st); err != nil {
		closeBody(resp.Body)
		return nil, st, fmt.Errorf("bad %s from the worker: %v: %w", api.HeaderStat, err, ErrInfra)
	}
	return &CopyStream{resp: resp}, st, nil
}

// CopyStream is the tar stream of CopyFrom.
type CopyStream struct{ resp *http.Response }

// Read reads the stream; at its end, the worker's error if it failed.
func (t *CopyStream) Read(p []byte) (int, error) {
	n, err := t.resp.Body.Read(p)
	if err == io.EOF {
		if v := t.resp.Trailer.Get(api.HeaderError); v != "" {
			var e api.Error
			if json.Unmarshal([]byte(v), &e) != nil || e.Message == "" {
				e = api.Error{Class: api.ClassInternal, Message: v}
			}
			return n, &Error{API: e}
		}
	}
	return n, err
}

// Report says what the stream left out; it is known once the stream
// was read to its end.
func (t *CopyStream) Report() api.CopyReport {
	var rep api.CopyReport
	json.Unmarshal([]byte(t.resp.Trailer.Get(api.HeaderSkipped)), &rep)
	return rep
}

// Close closes the stream.
func (t *CopyStream) Close() error { closeBody(t.resp.Body); return nil }

// CopyTo extracts the tar stream r into the directory dir of the
// sandbox: directories merge, files replace files whole. owners keeps
// the archive's owners (the sandbox's ids); else what is made is the
// sandbox root's.
func (s *Sandbox) CopyTo(ctx context.Context, dir string, r io.Reader, owners bool) (api.CopyReport, error) {
	q := url.Values{"path": {dir}}
	if owners {
		q.Set("owners", "1")
	}
	var rep api.CopyReport
	return rep, s.c.do(ctx, "PUT", s.path("/archive?"+q.Encode()), r, &rep)
}

func archiveQuery(p string, follow bool, name string) url.Values {
	q := url.Values{"path": {p}}
	if follow {
		q.Set("follow", "1")
	}
	if name != "" {
		q.Set("name", name)
	}
	return q
}
