package worker

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/archive"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/backend"
)

// exec runs a command: the body is an ExecRequest line, then the
// command's stdin; the response is Frame lines, the output as it is
// journaled, then the result.
func (w *worker) exec(rw http.ResponseWriter, r *http.Request) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return
	}
	body := bufio.NewReaderSize(r.Body, 64<<10)
	var req api.ExecRequest
	done := readBy(rw)
	err = firstLine(body, "exec", &req)
	done()
	if err != nil {
		fail(rw, err)
		return
	}
	if req.Detach && (req.Stdin || req.TTY) {
		fail(rw, fmt.Errorf("a detached exec has no stdin or terminal: %w", errdefs.ErrInvalidArgument))
		return
	}
	if req.ID == "" {
		req.ID = runtime.RandomName("x-")
	}
	// A new step in a sandbox frozen for the host's sake would hang
	// until the pressure passes: refused at once, to be retried (a
	// known id still gets its result).
	if _, err := e.sb.LookupExec(req.ID); errdefs.IsNotFound(err) && w.pressureFrozen(e.sb) {
		fail(rw, fmt.Errorf("sandbox %s (class batch) is frozen while the host is under memory pressure: retry the step once it passes (dsec inspect shows \"frozen\"): %w",
			e.sb.Name, errdefs.ErrResourceExhausted))
		return
	}
	w.primeAfter.execStarted(e.sb.Name)
	w.serveExec(rw, r, e.sb, req, body, api.Frame{})
	w.primeAfter.execEnded(e.sb.Name)
}

// firstLine reads a request's first line, the JSON of v (stdin follows).
func firstLine(body *bufio.Reader, what string, v any) error {
	line, err := body.ReadSlice('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("bad %s request: the first line must be the request (up to 64 KiB): %w", what, errdefs.ErrInvalidArgument)
	}
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("bad %s request: %v: %w", what, err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// serveExec runs req in sb and streams its frames: first (with the id
// set) first, the output, the result.
func (w *worker) serveExec(rw http.ResponseWriter, r *http.Request, sb *runtime.Sandbox, req api.ExecRequest, body *bufio.Reader, first api.Frame) {
	spec := runtime.ExecSpec{ID: req.ID, Args: req.Args, Env: req.Env, Cwd: req.Cwd, User: req.User, MaxOutput: w.cfg.MaxOutput}
	var master, stdinW *os.File
	var ours []*os.File // the command's ends, closed once the init has them
	switch {
	case req.TTY:
		m, tty, err := sb.Terminal()
		if err != nil {
			fail(rw, fmt.Errorf("allocate a terminal: %w", err))
			return
		}
		defer m.Close()
		rows, cols := req.Rows, req.Cols
		if rows <= 0 || cols <= 0 {
			rows, cols = 24, 80
		}
		if rc, err := m.SyscallConn(); err == nil { // not m.Fd(): m stays non-blocking
			rc.Control(func(fd uintptr) {
				unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: uint16(rows), Col: uint16(cols)})
			})
		}
		master, ours = m, []*os.File{tty}
		// The sandbox journals what the master shows (runtime.Run),
		// until the command ends.
		spec.Stdin, spec.Terminal, spec.TTY = tty, m, true
		spec.Env = append([]string{"TERM=xterm"}, spec.Env...)
	case req.Stdin:
		pr, pw, err := os.Pipe()
		if err != nil {
			fail(rw, err)
			return
		}
		defer pw.Close() // if the copier never starts
		stdinW, ours = pw, []*os.File{pr}
		spec.Stdin = pr
	}
	ex, replayed, err := sb.Run(r.Context(), spec)
	for _, f := range ours {
		f.Close()
	}
	if err != nil {
		fail(rw, err)
		return
	}
	rc := http.NewResponseController(rw)
	rc.EnableFullDuplex() // stdin keeps coming while output goes out
	if !replayed {
		switch {
		case master != nil:
			if req.Stdin {
				go io.Copy(master, body)
			}
		case stdinW != nil:
			go func(w *os.File) {
				io.Copy(w, body)
				w.Close() // the command's EOF
			}(stdinW)
		}
	}
	rw.Header().Set("Content-Type", "application/x-ndjson")
	if req.Stdin || req.TTY {
		// The copier may still be reading the body when the command
		// ends: this connection serves no further request.
		rw.Header().Set("Connection", "close")
	}
	rw.WriteHeader(http.StatusOK)
	if req.Detach {
		first.ID = ex.ID
		json.NewEncoder(rw).Encode(first)
		return
	}
	w.stream(r.Context(), rw, rc, ex, true, replayed, first)
}

// signal sends a signal to a running exec's process group.
func (w *worker) signal(r *http.Request, req api.SignalRequest) (none, error) {
	e, err := w.get(r)
	if err != nil {
		return none{}, err
	}
	sig := req.Signal
	if sig == 0 {
		sig = int(unix.SIGKILL)
	}
	if sig < 1 || sig > 64 {
		return none{}, fmt.Errorf("bad signal %d: give a number from 1 to 64 (9 is SIGKILL, 15 SIGTERM): %w", req.Signal, errdefs.ErrInvalidArgument)
	}
	return none{}, e.sb.Signal(r.Context(), r.PathValue("id"), unix.Signal(sig))
}

// logs replays a journaled exec's output (and, with follow=1, follows
// it to its result).
func (w *worker) logs(rw http.ResponseWriter, r *http.Request) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return
	}
	ex, err := e.sb.LookupExec(r.PathValue("id"))
	if err != nil {
		fail(rw, err)
		return
	}
	rw.Header().Set("Content-Type", "application/x-ndjson")
	rw.WriteHeader(http.StatusOK)
	w.stream(r.Context(), rw, http.NewResponseController(rw), ex, r.URL.Query().Get("follow") == "1", true, api.Frame{})
}

// stream sends an exec's journaled output from the start, as it grows,
// then its result. Without follow it stops at the end of what is
// there, with the result only if the command has ended: by then the
// output is closed (its writer closes it before the exit is told), and
// what a replay sends is what the step wrote, however often it is
// asked and whatever the sandbox did since.
func (w *worker) stream(ctx context.Context, rw io.Writer, rc *http.ResponseController, ex *runtime.Exec, follow, replayed bool, first api.Frame) {
	enc := json.NewEncoder(rw)
	first.ID = ex.ID
	enc.Encode(first)
	// Out at once: a client knows the step is under way (and its id)
	// before the command writes anything, however long it is silent.
	rc.Flush()
	var files [2]*os.File
	for i, p := range []string{ex.StdoutPath(), ex.StderrPath()} {
		f, err := os.Open(p)
		if err != nil {
			enc.Encode(api.Frame{Error: apiError(fmt.Errorf("exec %s: its output is gone: %w", ex.ID, err))})
			return
		}
		defer f.Close()
		files[i] = f
	}
	buf := make([]byte, 64<<10)
	pump := func() (sent int) {
		for i, f := range files {
			for {
				n, _ := f.Read(buf)
				if n == 0 {
					break
				}
				fr := api.Frame{Stdout: buf[:n]}
				if i == 1 {
					fr = api.Frame{Stderr: buf[:n]}
				}
				if enc.Encode(fr) != nil {
					return -1
				}
				sent += n
			}
		}
		if sent > 0 {
			rc.Flush()
		}
		return sent
	}
	wait := time.Millisecond
	for {
		n := pump()
		if n < 0 {
			return // the client went away; the command runs on
		}
		if n > 0 {
			wait = time.Millisecond
		}
		select {
		case <-ex.Done():
			pump()
			res, err := ex.Result(ctx)
			if err != nil {
				enc.Encode(api.Frame{Error: apiError(err)})
			} else {
				enc.Encode(api.Frame{Result: &api.ExecResult{ID: res.ID, ExitCode: res.ExitCode, OOM: res.OOM,
					Started: res.Started, Finished: res.Finished, Replayed: replayed,
					OutputTruncated: res.Truncated > 0, OutputTruncatedBytes: res.Truncated, OutputDropped: res.OutputDropped}})
			}
			rc.Flush()
			return
		default:
		}
		if !follow {
			rc.Flush()
			return
		}
		select {
		case <-ex.Done():
		case <-ctx.Done():
			return
		case <-time.After(wait):
			wait = min(2*wait, 50*time.Millisecond)
		}
	}
}

// openIn opens p inside the sandbox's root as the sandbox would resolve
// it (runtime.Sandbox.Files): symlinks (absolute ones included) and ".."
// stay inside the root, so a path the agent planted never leads the
// worker to a host file.
func openIn(sb *runtime.Sandbox, p string, flags int, mode os.FileMode) (archive.File, error) {
	if !path.IsAbs(p) || path.Clean(p) != p {
		return nil, fmt.Errorf("bad path %q: give a clean absolute path in the sandbox: %w", p, errdefs.ErrInvalidArgument)
	}
	s, err := sb.Files()
	if err != nil {
		return nil, err
	}
	defer s.Close()
	f, err := s.OpenFile(p[1:], flags, mode)
	if err != nil {
		return nil, pathError(sb, p, err)
	}
	return f, nil
}

// putFile writes a file into the sandbox atomically: a temporary file
// in the target's directory, renamed over the target.
func (w *worker) putFile(rw http.ResponseWriter, r *http.Request) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return
	}
	p := r.URL.Query().Get("path")
	mode := uint64(0o644)
	if m := r.URL.Query().Get("mode"); m != "" {
		if mode, err = strconv.ParseUint(m, 8, 32); err != nil || mode&^0o7777 != 0 {
			fail(rw, fmt.Errorf("bad mode %q: give octal permission bits like 0644: %w", m, errdefs.ErrInvalidArgument))
			return
		}
	}
	if p == "/" {
		fail(rw, fmt.Errorf("bad path /: name a file: %w", errdefs.ErrInvalidArgument))
		return
	}
	if !path.IsAbs(p) || path.Clean(p) != p {
		fail(rw, fmt.Errorf("bad path %q: give a clean absolute path in the sandbox: %w", p, errdefs.ErrInvalidArgument))
		return
	}
	s, err := e.sb.Files()
	if err != nil {
		fail(rw, err)
		return
	}
	defer s.Close()
	dir := path.Dir(p)[1:]
	if fi, err := s.Stat(cmp.Or(dir, ".")); err != nil || !fi.IsDir() {
		if err == nil {
			err = &fs.PathError{Op: "open", Path: path.Dir(p), Err: unix.ENOTDIR}
		}
		fail(rw, pathError(e.sb, path.Dir(p), err))
		return
	}
	tmp := path.Join(dir, ".dsec-put-"+runtime.RandomName(""))
	f, err := s.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, os.FileMode(mode))
	if err == nil {
		_, err = io.Copy(f, r.Body)
		if err == nil {
			err = f.Chmod(os.FileMode(mode) & os.ModePerm) // past the umask
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = s.Rename(tmp, p[1:])
		}
		if err != nil {
			s.Remove(tmp)
		}
	}
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		err = fmt.Errorf("the sandbox's disk is full (its quota, or the bound of sandboxes without one): %w", errdefs.ErrOutOfRange)
	}
	if err != nil {
		fail(rw, fmt.Errorf("write %s in sandbox %s: %w", p, e.sb.Name, err))
		return
	}
	rw.WriteHeader(http.StatusNoContent)
}

func (w *worker) getFile(rw http.ResponseWriter, r *http.Request) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return
	}
	p := r.URL.Query().Get("path")
	// Non-blocking, so that a fifo the agent left cannot hang the worker.
	f, err := openIn(e.sb, p, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		fail(rw, err)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		fail(rw, err)
		return
	}
	if !st.Mode().IsRegular() {
		fail(rw, fmt.Errorf("%s in sandbox %s is not a regular file (%s): %w", p, e.sb.Name, st.Mode().Type(), errdefs.ErrInvalidArgument))
		return
	}
	rw.Header().Set("Content-Type", "application/octet-stream")
	rw.Header().Set("Content-Length", strconv.FormatInt(st.Size(), 10))
	io.Copy(rw, f)
}

// sandboxFiles opens the files of a running sandbox for a copy.
func (w *worker) sandboxFiles(rw http.ResponseWriter, r *http.Request) (*runtime.Sandbox, backend.Files, string, bool) {
	e, err := w.get(r)
	if err != nil {
		fail(rw, err)
		return nil, nil, "", false
	}
	p := r.URL.Query().Get("path")
	if !path.IsAbs(p) {
		fail(rw, fmt.Errorf("bad path %q: give an absolute path in the sandbox: %w", p, errdefs.ErrInvalidArgument))
		return nil, nil, "", false
	}
	s, err := e.sb.Files()
	if err != nil {
		fail(rw, err)
		return nil, nil, "", false
	}
	return e.sb, s, path.Clean(p)[1:], true
}

// pathError classifies a failure to find a path in a sandbox.
func pathError(sb *runtime.Sandbox, p string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s: no such file or directory in sandbox %s: %w", p, sb.Name, errdefs.ErrNotFound)
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%s in sandbox %s is on another mount (its /proc, /sys or /dev): cp does not copy there: %w", p, sb.Name, errdefs.ErrInvalidArgument)
	case errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("%s in sandbox %s: not a directory: %w", p, sb.Name, errdefs.ErrInvalidArgument)
	}
	return fmt.Errorf("sandbox %s: %w", sb.Name, err)
}

// statPath answers stat with the path's stat, and GET archive with it
// as a header, then the tree at it as a tar stream: an error once the
// stream started is its X-Dsec-Error trailer, what it left out its
// X-Dsec-Skipped one.
func (w *worker) statPath(rw http.ResponseWriter, r *http.Request) {
	sb, s, p, ok := w.sandboxFiles(rw, r)
	if !ok {
		return
	}
	defer s.Close()
	q := r.URL.Query()
	follow := q.Get("follow") == "1"
	fi, err := s.Lstat(p)
	if err == nil && follow && fi.Mode()&fs.ModeSymlink != 0 {
		fi, err = s.Stat(p)
	}
	if err != nil {
		fail(rw, pathError(sb, "/"+p, err))
		return
	}
	st := api.PathStat{Name: path.Base("/" + p), Mode: fi.Mode(), Size: fi.Size(), Mtime: fi.ModTime()}
	if fi.Mode()&fs.ModeSymlink != 0 {
		st.LinkTarget, _ = s.Readlink(p)
	}
	if !strings.HasSuffix(r.URL.Path, "/archive") {
		reply(rw, st)
		return
	}
	b, _ := json.Marshal(st)
	rw.Header().Set(api.HeaderStat, string(b))
	rw.Header().Set("Content-Type", "application/x-tar")
	rw.Header().Set("Trailer", api.HeaderError+", "+api.HeaderSkipped)
	skipped, err := archive.Write(rw, s, p, archive.WriteOptions{Name: q.Get("name"), Follow: follow, IDs: s.IDs()})
	if err != nil {
		b, _ := json.Marshal(apiError(pathError(sb, "/"+p, err)))
		rw.Header().Set(api.HeaderError, string(b))
	}
	if len(skipped) > 0 {
		b, _ := json.Marshal(api.CopyReport{Skipped: skipped})
		rw.Header().Set(api.HeaderSkipped, string(b))
	}
}

// putArchive extracts a tar stream into a directory of the sandbox.
func (w *worker) putArchive(rw http.ResponseWriter, r *http.Request) {
	sb, s, p, ok := w.sandboxFiles(rw, r)
	if !ok {
		return
	}
	defer s.Close()
	skipped, err := archive.Extract(r.Body, s, path.Join(".", p), archive.ExtractOptions{Owners: r.URL.Query().Get("owners") == "1"})
	if err != nil {
		fail(rw, pathError(sb, "/"+p, err))
		return
	}
	reply(rw, api.CopyReport{Skipped: skipped})
}
