// Package sdk is the Go client of a dsec worker: create sandboxes, run
// steps in them exactly once, move files in and out, stop, start and
// remove them. It speaks the API of package api over the worker's unix
// socket, <root>/dsec.sock.
//
//	c, err := sdk.New(sdk.Options{Root: "/var/lib/dsec"})
//	sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"toolkit:1", "ws:7", "debian:12"}})
//	res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "rollout-3/step-17", Args: []string{"pytest", "-x"}, Stdout: os.Stdout})
//
// Errors: a command that fails is not an error (its ExitCode says how it
// ended); an error for which IsInfra reports true means the sandbox or
// the worker failed under the call, so the step says nothing about the
// agent. Retrying an Exec with the same ID never runs the command twice:
// it returns the recorded output and result, or waits for them. Other
// errors match the errdefs classes (errdefs.IsNotFound, IsAlreadyExists,
// IsInvalidArgument, IsFailedPrecondition for a sandbox in the wrong
// state).
package sdk

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
)

// Options say where the worker is.
type Options struct {
	Root string // the worker's root: its socket is Root/dsec.sock
	// Host, instead of Root, is a worker's TCP API: tcp://HOST:PORT
	// (dsec daemon --listen). Every request carries Token. TLS is used
	// when TLSCA or a client certificate is given, or the host is off
	// loopback (then the system's roots verify the worker).
	Host  string
	Token string
	// TLSCA is the PEM file of the CA the worker's certificate is
	// checked against; ClientCert and ClientKey the client's own, for a
	// worker that asks for one (--tls-client-ca).
	TLSCA, ClientCert, ClientKey string
	// Dial, with Host, reaches that worker some other way than a TCP
	// dial; the requests are plain HTTP over what it returns.
	Dial func(ctx context.Context) (net.Conn, error)
	// Transport, with Host, carries the requests instead (one shared by
	// many clients: the worker's E2B front, in process); Dial and the
	// TLS options are not used then.
	Transport http.RoundTripper
	// StartWorker, if set, is the command that starts a worker for Root
	// when none answers (for example dsec --root ROOT daemon); it runs
	// detached, its output in Root/worker.log. Started is called with its
	// pid.
	StartWorker []string
	Started     func(pid int)
}

// Client talks to one worker.
type Client struct {
	opts Options
	hc   *http.Client
	base string // the API's URL, up to the version
	// first is the connection New dialed to find the worker: the first
	// request, if it comes within a second (a worker closes idle
	// connections), goes over it alone (oneShot).
	first  atomic.Pointer[net.Conn]
	dialed time.Time
}

// ErrInfra marks failures of the sandbox, the worker or the host rather
// than of a command (errdefs.IsUnavailable matches it too).
var ErrInfra = api.ErrInfra

// IsInfra reports whether err is an infrastructure failure.
func IsInfra(err error) bool { return errors.Is(err, ErrInfra) || errdefs.IsUnavailable(err) }

// New returns a client of the worker at opts.Root, starting one if
// asked and none answers.
func New(opts Options) (*Client, error) {
	if opts.Host != "" {
		return newRemote(opts)
	}
	sock := filepath.Join(opts.Root, api.Socket)
	c := &Client{opts: opts, base: "http://dsec/" + api.Version, hc: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
		DisableCompression: true,
	}}}
	conn, err := net.Dial("unix", sock)
	if err == nil {
		c.dialed = time.Now()
		c.first.Store(&conn)
		return c, nil
	}
	if len(opts.StartWorker) == 0 {
		return nil, fmt.Errorf("no dsec worker answers on %s (start one with dsec daemon): %w", sock, ErrInfra)
	}
	if err := c.startWorker(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Client) startWorker() error {
	if err := os.MkdirAll(c.opts.Root, 0o700); err != nil {
		return err
	}
	logPath := filepath.Join(c.opts.Root, "worker.log")
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.Command(c.opts.StartWorker[0], c.opts.StartWorker[1:]...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // not the caller's terminal's
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start a worker: %w", err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		if _, err := c.Version(context.Background()); err == nil {
			if c.opts.Started != nil {
				c.opts.Started(cmd.Process.Pid)
			}
			return nil
		}
		select {
		case <-exited:
			// Another client's worker may have won the race for the root.
			if _, err := c.Version(context.Background()); err == nil {
				return nil
			}
			return fmt.Errorf("the worker exited at once (exit %d): see %s: %w", cmd.ProcessState.ExitCode(), logPath, ErrInfra)
		case <-time.After(10 * time.Millisecond):
		}
	}
	return fmt.Errorf("the worker started but does not answer: see %s: %w", logPath, ErrInfra)
}

// Error is an error the worker returned.
type Error struct{ API api.Error }

// Unwrap gives the errdefs class (api's error table); ErrInfra for
// an infrastructure failure.
func (e *Error) Unwrap() error {
	if e.API.Class == api.ClassInfra {
		return ErrInfra
	}
	return e.API.Unwrap()
}

func (e *Error) Error() string { return e.API.Message }

func (c *Client) do(ctx context.Context, method, path string, body io.Reader, out any) error {
	resp, err := c.send(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer closeBody(resp.Body)
	if out == nil {
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("%s %s: bad answer from the worker: %v: %w", method, path, err, ErrInfra)
	}
	return nil
}

// closeBody reads what is left of an answer (a stream's last chunk), so
// that its connection serves the next request, and closes it.
func closeBody(b io.ReadCloser) {
	io.Copy(io.Discard, io.LimitReader(b, 64<<10))
	b.Close()
}

// send makes a request; an error status becomes an *Error.
func (c *Client) send(ctx context.Context, method, path string, body io.Reader) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return nil, err
	}
	if c.opts.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.opts.Token)
	}
	var resp *http.Response
	if conn := c.takeFirst(); conn != nil {
		resp, err = oneShot(ctx, conn, req)
	} else {
		resp, err = c.hc.Do(req)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("no answer from the dsec worker at %s (%v): is it running? (dsec daemon); a retried exec with the same id never runs twice: %w", c.where(), err, ErrInfra)
	}
	if resp.StatusCode >= 300 {
		defer closeBody(resp.Body)
		var e api.Error
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		if json.Unmarshal(b, &e) != nil || e.Message == "" {
			e = api.Error{Class: api.ClassOfStatus(resp.StatusCode), Message: fmt.Sprintf("%s %s: %s", method, path, resp.Status)}
		}
		if e.Class == "" {
			e.Class = api.ClassInternal
		}
		if e.Class == api.ClassUnauthorized && c.Remote() {
			return nil, fmt.Errorf("the worker at %s refused the token: give a valid one in DSEC_TOKEN or the config's token (dsec token ls on the worker's host lists them): %w", c.opts.Host, &Error{API: e})
		}
		return nil, &Error{API: e}
	}
	return resp, nil
}

// takeFirst gives the connection New dialed, once, if it is still fresh.
func (c *Client) takeFirst() net.Conn {
	conn := c.first.Swap(nil)
	if conn == nil {
		return nil
	}
	if time.Since(c.dialed) >= time.Second {
		(*conn).Close()
		return nil
	}
	return *conn
}

// oneShot makes req over conn alone, outside the transport's pool: a CLI
// makes one request, and the pool's reading and writing goroutines, and
// its code run for the first time, cost it 0.25-0.5 ms here (cold pages,
// hand-offs between threads; BENCHMARKS.md). The answer's body closes
// conn, as does ctx ending first. A body the worker may read while it
// answers, or answer before reading (a command's stdin; any of unknown
// length), is written from a goroutine; a small one at once. No retry:
// conn is under a second old, and the worker waits ten for a request.
func oneShot(ctx context.Context, conn net.Conn, req *http.Request) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	var err error
	if req.Body == nil || req.Body == http.NoBody || (req.ContentLength > 0 && req.ContentLength <= 32<<10) {
		err = req.Write(conn)
	} else {
		go req.Write(conn) // fails, and ends, when conn closes
	}
	var resp *http.Response
	if err == nil {
		resp, err = http.ReadResponse(bufio.NewReader(conn), req)
	}
	if err != nil {
		stop()
		conn.Close()
		return nil, err
	}
	resp.Body = &connBody{ReadCloser: resp.Body, conn: conn, stop: stop}
	return resp, nil
}

// connBody is the body of a oneShot answer: closing it closes its
// connection.
type connBody struct {
	io.ReadCloser
	conn net.Conn
	stop func() bool
}

func (b *connBody) Close() error {
	b.stop()
	b.ReadCloser.Close()
	return b.conn.Close()
}

// Version asks the worker who it is.
func (c *Client) Version(ctx context.Context) (api.VersionInfo, error) {
	var v api.VersionInfo
	return v, c.do(ctx, "GET", "/version", nil, &v)
}

// Nodes are the workers of a gateway's fleet, as it knows them (an
// admin token of the gateway's).
func (c *Client) Nodes(ctx context.Context) ([]api.Node, error) {
	var out []api.Node
	return out, c.do(ctx, "GET", "/nodes", nil, &out)
}

// Cordon stops a gateway placing creates on the worker node (its URL or
// HOST:PORT), or with on false lets it again.
func (c *Client) Cordon(ctx context.Context, node string, on bool) error {
	verb := "/uncordon"
	if on {
		verb = "/cordon"
	}
	return c.do(ctx, "POST", "/nodes/"+url.PathEscape(node)+verb, nil, nil)
}

// Shutdown asks the worker to exit; its sandboxes run on.
func (c *Client) Shutdown(ctx context.Context) error { return c.do(ctx, "POST", "/shutdown", nil, nil) }

// Sandbox is a handle on a sandbox by name.
type Sandbox struct {
	c    *Client
	Name string
	// Info is the sandbox as the worker described it when it made it
	// (Create, Branch): its ID, owner, layers and limits. A handle from
	// Client.Sandbox has none: Inspect asks.
	Info api.Sandbox
}

// Sandbox returns a handle on an existing sandbox.
func (c *Client) Sandbox(name string) *Sandbox { return &Sandbox{c: c, Name: name} }

// Create creates and starts a sandbox; the backend is spec.Backend
// (default container).
func (c *Client) Create(ctx context.Context, spec api.SandboxSpec) (*Sandbox, error) {
	b, _ := json.Marshal(spec)
	var out api.Sandbox
	if err := c.do(ctx, "POST", "/sandboxes", bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &Sandbox{c: c, Name: out.Name, Info: out}, nil
}

// Batch asks for count sandboxes of spec at once (POST /v1/batches: a
// rollout's burst, one request) and calls each with every one as it is
// made, or why it was not (item.Error), in no order; it returns once
// all are answered. Named spec.Name-0 ... (none: generated). Through a
// gateway they are spread over its workers.
func (c *Client) Batch(ctx context.Context, spec api.SandboxSpec, count int, each func(api.BatchItem)) error {
	b, _ := json.Marshal(api.BatchRequest{Spec: spec, Count: count})
	resp, err := c.send(ctx, "POST", "/batches", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer closeBody(resp.Body)
	dec := json.NewDecoder(resp.Body)
	for n := range count {
		var it api.BatchItem
		if err := dec.Decode(&it); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("a batch's answer ended after %d of %d sandboxes: %v: %w", n, count, err, ErrInfra)
		}
		each(it)
	}
	return nil
}

// List describes every sandbox of the worker, oldest first, queued ones
// included, warm FnCall sandboxes not.
func (c *Client) List(ctx context.Context) ([]api.Sandbox, error) {
	var out []api.Sandbox
	return out, c.do(ctx, "GET", "/sandboxes", nil, &out)
}

// ListBrief is List without what each sandbox uses now (its memory,
// disk, CPU time and execs, each read from its groups and disk): what
// a poller of many sandboxes needs, at a fraction of the cost.
func (c *Client) ListBrief(ctx context.Context) ([]api.Sandbox, error) {
	var out []api.Sandbox
	return out, c.do(ctx, "GET", "/sandboxes?brief=1", nil, &out)
}

// ListAll is List with the warm sandboxes of FnCall pools.
func (c *Client) ListAll(ctx context.Context) ([]api.Sandbox, error) {
	var out []api.Sandbox
	return out, c.do(ctx, "GET", "/sandboxes?all=1", nil, &out)
}

func (s *Sandbox) path(p string) string { return "/sandboxes/" + url.PathEscape(s.Name) + p }

// Inspect describes the sandbox.
func (s *Sandbox) Inspect(ctx context.Context) (api.Sandbox, error) {
	var out api.Sandbox
	return out, s.c.do(ctx, "GET", s.path(""), nil, &out)
}

// Stop kills the sandbox's processes; its files stay.
func (s *Sandbox) Stop(ctx context.Context) error {
	return s.c.do(ctx, "POST", s.path("/stop"), nil, nil)
}

// Start starts a stopped sandbox again on its files.
func (s *Sandbox) Start(ctx context.Context) error {
	return s.c.do(ctx, "POST", s.path("/start"), nil, nil)
}

// Pause freezes the sandbox's processes where they are, their memory
// kept, until Resume; a paused sandbox runs no exec.
func (s *Sandbox) Pause(ctx context.Context) error {
	return s.c.do(ctx, "POST", s.path("/pause"), nil, nil)
}

// Idle hints that the sandbox will wait about expected (for the model's
// next turn): the worker freezes one expected to wait long enough
// (reclaim.hint_min_wait) and gives its memory back to the host; its
// next exec resumes it first, so a caller sees no difference but that
// exec's latency. The report says whether it was frozen, and the memory
// charged to it before and after.
func (s *Sandbox) Idle(ctx context.Context, expected time.Duration) (*api.IdleReport, error) {
	b, _ := json.Marshal(api.IdleRequest{ExpectedSeconds: expected.Seconds()})
	var out api.IdleReport
	if err := s.c.do(ctx, "POST", s.path("/idle"), bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Resume lets a paused sandbox run on where it was (an evicted
// microVM's guest is restored first).
func (s *Sandbox) Resume(ctx context.Context) error {
	return s.c.do(ctx, "POST", s.path("/resume"), nil, nil)
}

// Evict pauses a microVM (a paused one stays so) and saves its guest to
// the worker's disk, giving its memory back to the host; Resume restores
// it. The worker evicts paused microVMs itself under memory pressure.
// Another backend's sandbox: errdefs.ErrNotImplemented.
func (s *Sandbox) Evict(ctx context.Context) error {
	return s.c.do(ctx, "POST", s.path("/evict"), nil, nil)
}

// Signal sends sig (0: SIGKILL) to the running exec id's process
// group. errdefs.IsFailedPrecondition: it has ended.
func (s *Sandbox) Signal(ctx context.Context, id string, sig syscall.Signal) error {
	b, _ := json.Marshal(api.SignalRequest{Signal: int(sig)})
	return s.c.do(ctx, "POST", s.path("/execs/"+url.PathEscape(id)+"/signal"), bytes.NewReader(b), nil)
}

// Remove removes the sandbox; a running one only with force.
func (s *Sandbox) Remove(ctx context.Context, force bool) error {
	p := s.path("")
	if force {
		p += "?force=1"
	}
	return s.c.do(ctx, "DELETE", p, nil, nil)
}

// ExecOptions describe a step.
type ExecOptions struct {
	// ID makes the step run at most once: the same ID again returns the
	// recorded output and result. Default: a fresh id.
	ID   string
	Args []string
	Env  []string // over the sandbox's
	Cwd  string
	// User runs it as a user of the sandbox (a name, uid or uid:gid;
	// default root).
	User string
	// Stdin, if set, is copied to the command (else /dev/null).
	Stdin io.Reader
	// Output; nil discards it.
	Stdout, Stderr io.Writer
	// TTY runs the command on a terminal of Rows x Cols; its output all
	// comes as Stdout.
	TTY        bool
	Rows, Cols int
	// Detach returns once the command started, with a zero result; Logs
	// collects its output and result later.
	Detach bool
	// Started, if set, is called once the worker says the command runs
	// (or ran: a replay), with its id, before any output.
	Started func(id string)
}

// Exec runs a command in the sandbox and returns how it ended; the
// output streams to opts.Stdout and opts.Stderr as it comes, as the
// sandbox's journal keeps it: up to the worker's exec.max_output
// (stdout and stderr together, no more than the sandbox's disk bound).
// The result's OutputTruncated and OutputTruncatedBytes say what passed
// the cap was dropped; a replay's OutputDropped, that the journal
// dropped the output since, to stay within the sandbox's disk bound.
func (s *Sandbox) Exec(ctx context.Context, opts ExecOptions) (api.ExecResult, error) {
	req := opts.request()
	resp, err := s.c.send(ctx, "POST", s.path("/exec"), withStdin(req, opts.Stdin))
	if err != nil {
		return api.ExecResult{}, err
	}
	defer closeBody(resp.Body)
	res, err := readFrames(ctx, resp.Body, opts.Stdout, opts.Stderr, !opts.Detach, nil, opts.Started)
	if opts.Detach && errors.Is(err, ErrRunning) {
		err = nil
	}
	return res, err
}

func (opts ExecOptions) request() api.ExecRequest {
	return api.ExecRequest{ID: opts.ID, Args: opts.Args, Env: opts.Env, Cwd: opts.Cwd, User: opts.User, Stdin: opts.Stdin != nil,
		TTY: opts.TTY, Rows: opts.Rows, Cols: opts.Cols, Detach: opts.Detach}
}

// withStdin is a request body: the request's line, then stdin.
func withStdin(req any, stdin io.Reader) io.Reader {
	line, _ := json.Marshal(req)
	var body io.Reader = bytes.NewReader(append(line, '\n'))
	if stdin != nil {
		body = io.MultiReader(body, stdin)
	}
	return body
}

// CallOptions describe a call on the FnCall backend: a command in a
// fresh sandbox taken warm from Pool, or from the pool whose template is
// Spec (with no such pool, one is made for the call), discarded after.
// ExecOptions' ID and Detach do not apply.
type CallOptions struct {
	Pool string
	Spec *api.SandboxSpec
	// Run: dsec run --rm, a sandbox made from Spec for the call, with
	// its name, and removed after it (api.CallRequest).
	Run bool
	ExecOptions
}

// CallResult is how a call's command ended and where it ran.
type CallResult struct {
	api.ExecResult
	api.CallInfo
}

// Call runs a command in a sandbox discarded after it: a warm one of a
// FnCall pool, or one made for it (opts.Run: dsec run --rm).
func (c *Client) Call(ctx context.Context, opts CallOptions) (CallResult, error) {
	req := api.CallRequest{Pool: opts.Pool, Spec: opts.Spec, Run: opts.Run, ExecRequest: opts.request()}
	resp, err := c.send(ctx, "POST", "/calls", withStdin(req, opts.Stdin))
	if err != nil {
		return CallResult{}, err
	}
	defer closeBody(resp.Body)
	var out CallResult
	out.ExecResult, err = readFrames(ctx, resp.Body, opts.Stdout, opts.Stderr, true, &out.CallInfo, opts.Started)
	return out, err
}

// Pools describes the FnCall pools.
func (c *Client) Pools(ctx context.Context) ([]api.Pool, error) {
	var out []api.Pool
	return out, c.do(ctx, "GET", "/pools", nil, &out)
}

// ResizePool sets a pool's size, creating it from spec.Spec if new.
func (c *Client) ResizePool(ctx context.Context, name string, spec api.PoolSpec) (api.Pool, error) {
	b, _ := json.Marshal(spec)
	var out api.Pool
	return out, c.do(ctx, "PUT", "/pools/"+url.PathEscape(name), bytes.NewReader(b), &out)
}

// Estimate asks a worker, as its admin, what a create on req's layers
// would fetch there (a gateway's placement asks it).
func (c *Client) Estimate(ctx context.Context, req api.EstimateRequest) (api.Estimate, error) {
	b, _ := json.Marshal(req)
	var out api.Estimate
	return out, c.do(ctx, "POST", "/estimates", bytes.NewReader(b), &out)
}

// RemovePool removes a pool and discards its warm sandboxes.
func (c *Client) RemovePool(ctx context.Context, name string) error {
	return c.do(ctx, "DELETE", "/pools/"+url.PathEscape(name), nil, nil)
}

// Logs writes the recorded output of the exec id; with follow it waits
// for the command to end and returns its result. Without follow a
// command still running returns a zero result and ErrRunning.
func (s *Sandbox) Logs(ctx context.Context, id string, follow bool, stdout, stderr io.Writer) (api.ExecResult, error) {
	p := s.path("/execs/" + url.PathEscape(id))
	if follow {
		p += "?follow=1"
	}
	resp, err := s.c.send(ctx, "GET", p, nil)
	if err != nil {
		return api.ExecResult{}, err
	}
	defer closeBody(resp.Body)
	return readFrames(ctx, resp.Body, stdout, stderr, follow, nil, nil)
}

// ErrRunning says a command has no result yet.
var ErrRunning = errors.New("the command is still running")

// readFrames reads an exec's frames; call, if set, gets a call's info,
// started the id once the first frame names it.
func readFrames(ctx context.Context, r io.Reader, stdout, stderr io.Writer, needResult bool, call *api.CallInfo, started func(string)) (api.ExecResult, error) {
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 256<<10), 1<<20)
	id := ""
	for sc.Scan() {
		var f api.Frame
		if err := json.Unmarshal(sc.Bytes(), &f); err != nil {
			return api.ExecResult{}, fmt.Errorf("bad frame from the worker: %v: %w", err, ErrInfra)
		}
		if f.ID != "" {
			if id == "" && started != nil {
				started(f.ID)
			}
			id = f.ID
		}
		if f.Call != nil && call != nil {
			*call = *f.Call
		}
		switch {
		case f.Error != nil:
			return api.ExecResult{}, &Error{API: *f.Error}
		case f.Result != nil:
			return *f.Result, nil
		}
		if len(f.Stdout) > 0 {
			if _, err := stdout.Write(f.Stdout); err != nil {
				return api.ExecResult{}, err
			}
		}
		if len(f.Stderr) > 0 {
			if _, err := stderr.Write(f.Stderr); err != nil {
				return api.ExecResult{}, err
			}
		}
	}
	if !needResult && sc.Err() == nil {
		return api.ExecResult{}, ErrRunning
	}
	if err := ctx.Err(); err != nil { // the caller stopped waiting
		if id == "" {
			return api.ExecResult{}, err
		}
		return api.ExecResult{}, fmt.Errorf("stopped waiting for the result of exec %s: %w; it runs on in the sandbox: collect it with the same id", id, err)
	}
	// The worker went away mid-command: the command runs on in its
	// sandbox and a retry with the same id collects its result.
	if id == "" {
		return api.ExecResult{}, fmt.Errorf("lost the worker before it answered; if the exec had an id, retrying with it never runs it twice: %w", ErrInfra)
	}
	return api.ExecResult{}, fmt.Errorf("lost the worker before the result of exec %s; it runs on in the sandbox: collect it with the same id (dsec exec --id %s, or dsec logs -f --id %s): %w", id, id, id, ErrInfra)
}

// PackDiff snapshots the sandbox's files: it is frozen for the time it
// takes to pack what it wrote (since its previous snapshot, which is
// the parent) into a layer tagged req.Tag (NAME:STEP), then runs on.
// Processes are not captured.
func (s *Sandbox) PackDiff(ctx context.Context, req api.PackRequest) (api.Snapshot, error) {
	b, _ := json.Marshal(req)
	var out api.Snapshot
	return out, s.c.do(ctx, "POST", s.path("/snapshots"), bytes.NewReader(b), &out)
}

// Grade grades the sandbox in a fresh one (api.GradeRequest): the
// grader's layers over what the carry rules take of its changes over
// its own layers, with no network and none of its processes. The
// answer holds the grader's exit code, output and JSON result, and a
// tamper report of what the grade left out. A retry with the same
// req.ID answers what the first answered; the sandbox runs on.
func (s *Sandbox) Grade(ctx context.Context, req api.GradeRequest) (*api.Grade, error) {
	if req.ID == "" {
		var b [8]byte
		rand.Read(b[:])
		req.ID = "grade-" + hex.EncodeToString(b[:]) // (a retry of this call is the same grade)
	}
	b, _ := json.Marshal(req)
	var out api.Grade
	if err := s.c.do(ctx, "POST", s.path("/grade"), bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ApplyPolicy applies a policy to the sandbox (req.Policy, or the one
// stored under req.Name). The report says what took effect for every
// process now and what holds for processes started from now on only;
// a policy that would loosen file or syscall rules is refused
// (errdefs.ErrFailedPrecondition).
func (s *Sandbox) ApplyPolicy(ctx context.Context, req api.PolicyRequest) (*api.PolicyReport, error) {
	b, _ := json.Marshal(req)
	var out api.PolicyReport
	if err := s.c.do(ctx, "POST", s.path("/policy"), bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SavePolicy stores p under name, for SandboxSpec.PolicyName and
// PolicyRequest.Name.
func (c *Client) SavePolicy(ctx context.Context, name string, p *api.Policy) error {
	b, _ := json.Marshal(p)
	return c.do(ctx, "PUT", "/policies/"+url.PathEscape(name), bytes.NewReader(b), nil)
}

// Policies lists the stored policies.
func (c *Client) Policies(ctx context.Context) ([]api.Policy, error) {
	var out []api.Policy
	return out, c.do(ctx, "GET", "/policies", nil, &out)
}

// Policy reads the stored policy name.
func (c *Client) Policy(ctx context.Context, name string) (*api.Policy, error) {
	var out api.Policy
	if err := c.do(ctx, "GET", "/policies/"+url.PathEscape(name), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// RemovePolicy removes the stored policy name; sandboxes keep theirs.
func (c *Client) RemovePolicy(ctx context.Context, name string) error {
	return c.do(ctx, "DELETE", "/policies/"+url.PathEscape(name), nil, nil)
}

// Snapshots lists the snapshots, oldest first, with their lineage: the
// parent, the snapshots taken over each, and the sandboxes on each.
func (c *Client) Snapshots(ctx context.Context) ([]api.SnapshotNode, error) {
	var out []api.SnapshotNode
	return out, c.do(ctx, "GET", "/snapshots", nil, &out)
}

// Snapshot is the snapshot named name (NAME:STEP) with its lineage, as
// Snapshots lists it; errdefs.ErrNotFound if there is none the caller
// sees. A worker answers it without reading the whole lineage when name
// is no snapshot.
func (c *Client) Snapshot(ctx context.Context, name string) (api.SnapshotNode, error) {
	var out []api.SnapshotNode
	if err := c.do(ctx, "GET", "/snapshots?name="+url.QueryEscape(name), nil, &out); err != nil {
		return api.SnapshotNode{}, err
	}
	for _, n := range out { // an older worker lists them all
		if n.Name == name {
			return n, nil
		}
	}
	return api.SnapshotNode{}, fmt.Errorf("no snapshot %s: %w", name, errdefs.ErrNotFound)
}

// RemoveSnapshot untags snapshot ref (NAME:STEP). Unless forced it
// refuses (errdefs.ErrFailedPrecondition) while a snapshot or sandbox
// stands on it.
func (c *Client) RemoveSnapshot(ctx context.Context, ref string, force bool) error {
	q := ""
	if force {
		q = "?force=1"
	}
	return c.do(ctx, "DELETE", "/snapshots/"+(&url.URL{Path: ref}).EscapedPath()+q, nil, nil)
}

// Squash folds the chain of snapshots ending in snapshot into one new
// snapshot tagged tag (NAME:STEP) over the same base layers.
func (c *Client) Squash(ctx context.Context, snapshot, tag string) (*api.Snapshot, error) {
	b, _ := json.Marshal(api.SquashRequest{Snapshot: snapshot, Tag: tag})
	var out api.Snapshot
	if err := c.do(ctx, "POST", "/squash", bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Branch starts req.N sandboxes on one snapshot, each with its own
// empty upper over the shared read-only layers; all or none. To start
// one sandbox on a snapshot, Create with SandboxSpec.Snapshot.
func (c *Client) Branch(ctx context.Context, req api.BranchRequest) ([]*Sandbox, error) {
	b, _ := json.Marshal(req)
	var out []api.Sandbox
	if err := c.do(ctx, "POST", "/branches", bytes.NewReader(b), &out); err != nil {
		return nil, err
	}
	sbs := make([]*Sandbox, len(out))
	for i, d := range out {
		sbs[i] = &Sandbox{c: c, Name: d.Name, Info: d}
	}
	return sbs, nil
}
