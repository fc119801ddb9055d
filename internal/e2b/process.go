package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	pb "github.com/dsec-project/dsec/internal/e2b/envd/process"
	"github.com/dsec-project/dsec/sdk"
)

// envd's Process service over dsec's execs. A command is a dsec exec
// under an id of the sandbox's journal; its pid is the front's number
// for it, in the sandbox's record, so Connect, SendSignal and List find
// it after the SDK's stream is gone and after a worker restart.
//
// Retries. E2B's protocol carries no request id: a Start the SDK sends
// again is a new command to envd. dsec sees a retry where the protocol
// names the command:
//   - Connect to a pid streams the command's journaled output from its
//     start and its exit, however long ago it ended (a client that lost
//     its stream, or its process, reattaches and gets the recorded
//     result; the command does not run again);
//   - a Start whose tag names a command started before, or whose envs
//     carry DSEC_EXEC_ID (the journal's id, taken out of the command's
//     environment), is that command again: its recorded output and
//     exit, never a second run (frameworks pass envs through as they
//     are, so a trainer sets the step's id there).

// ExecIDEnv is the environment variable a Start names its dsec exec id
// by: the same id again is the same command, run once.
const ExecIDEnv = "DSEC_EXEC_ID"

// defaultKeepalive is the keepalive interval of a stream whose client
// asks for none (envd's).
const defaultKeepalive = 90 * time.Second

// live is a command this front started and still follows.
type live struct {
	proc
	sandbox string
	c       *sdk.Client
	stdin   *io.PipeWriter // nil: started without stdin

	out      chan chunk    // to the Start stream while it is there
	detached chan struct{} // closed once it is gone
	once     sync.Once
	started  chan struct{}
	done     chan struct{}
	res      api.ExecResult
	err      error
}

type chunk struct {
	stderr bool
	b      []byte
}

// detach lets go of the Start stream: output goes to the journal only.
func (l *live) detach() { l.once.Do(func() { close(l.detached) }) }

// writer is a command's stdout or stderr as the Start stream takes it.
type writer struct {
	l      *live
	stderr bool
}

func (w writer) Write(b []byte) (int, error) {
	select {
	case w.l.out <- chunk{w.stderr, slices.Clone(b)}:
	case <-w.l.detached:
	}
	return len(b), nil
}

// procTable holds the live commands by sandbox and pid, and the pids of
// those that ended (so List asks the journal only of commands an
// earlier worker's front started).
type procTable struct {
	mu    sync.Mutex
	m     map[string]map[uint32]*live
	ended map[string]map[uint32]bool
}

func newProcTable() *procTable {
	return &procTable{m: map[string]map[uint32]*live{}, ended: map[string]map[uint32]bool{}}
}

func (t *procTable) add(l *live) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[l.sandbox] == nil {
		t.m[l.sandbox] = map[uint32]*live{}
	}
	t.m[l.sandbox][l.PID] = l
}

func (t *procTable) get(sandbox string, pid uint32) *live {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[sandbox][pid]
}

// finish moves l from the live commands to the ended ones.
func (t *procTable) finish(l *live) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m[l.sandbox][l.PID] == l {
		delete(t.m[l.sandbox], l.PID)
	}
	if t.ended[l.sandbox] == nil {
		t.ended[l.sandbox] = map[uint32]bool{}
	}
	t.ended[l.sandbox][l.PID] = true
}

// hasEnded says whether this front saw the command pid end.
func (t *procTable) hasEnded(sandbox string, pid uint32) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ended[sandbox][pid]
}

func (t *procTable) running(sandbox string) map[uint32]*live {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.m[sandbox])
}

func (t *procTable) drop(sandbox string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, sandbox)
	delete(t.ended, sandbox)
}

// processService implements envd's Process service.
type processService struct{ s *Server }

// envdClient is the worker as an envd request's caller (envdAuth) sees
// it, and the sandbox the request is for, which must have a record (one
// dsec made outside E2B gets one).
func (s *Server) envdClient(ctx context.Context, _ http.Header) (*sdk.Client, string, error) {
	c, id := s.as(callerOf(ctx)), sandboxOf(ctx)
	if _, ok := s.records.get(id); ok {
		return c, id, nil
	}
	sb, err := inspect(ctx, c, id)
	if err != nil {
		return nil, "", err
	}
	return c, id, s.ensureRecord(sb)
}

// userOf is the user a request asks for (Basic auth's name; none:
// root, dsec's default, "" here).
func userOf(h http.Header) string {
	r := http.Request{Header: h}
	user, _, _ := r.BasicAuth()
	if user == "root" {
		return ""
	}
	return user
}

// rootOnly refuses a file operation as another user than root: dsec
// makes files as the sandbox's root.
func rootOnly(user string) error {
	if user != "" && user != "root" {
		return fmt.Errorf("user %q: dsec's E2B front reads and writes files as the sandbox's root: pass user: 'root', or none (commands run as any user): %w", user, errdefs.ErrNotImplemented)
	}
	return nil
}

// processTimeout is the command's lifetime the request asks for
// (Connect-Timeout-Ms; 0: none).
func processTimeout(h http.Header) time.Duration {
	ms, err := strconv.ParseInt(h.Get("Connect-Timeout-Ms"), 10, 64)
	if err != nil || ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

func keepaliveOf(h http.Header) time.Duration {
	s, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval"))
	if err != nil || s <= 0 {
		return defaultKeepalive
	}
	return time.Duration(s) * time.Second
}

func (p processService) Start(ctx context.Context, req *connect.Request[pb.StartRequest], stream *connect.ServerStream[pb.StartResponse]) error {
	c, id, err := p.s.envdClient(ctx, req.Header())
	if err != nil {
		return connErr(err)
	}
	m := req.Msg
	if m.Pty != nil {
		return connect.NewError(connect.CodeUnimplemented, errors.New("terminals (pty) are not served by dsec's E2B front yet: run the command without one, or use dsec exec -t"))
	}
	cfg := m.GetProcess()
	if cfg.GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("no command: give process.cmd"))
	}
	send := func(ev *pb.ProcessEvent) error { return stream.Send(&pb.StartResponse{Event: ev}) }
	envs := maps.Clone(cfg.GetEnvs())
	execID := envs[ExecIDEnv]
	delete(envs, ExecIDEnv)
	// The same command again: its record, then its journal.
	if rec, ok := p.s.records.get(id); ok {
		for _, pr := range rec.Procs {
			if execID != "" && pr.Exec == execID || m.GetTag() != "" && pr.Tag == m.GetTag() {
				return p.s.replay(ctx, c, id, pr, keepaliveOf(req.Header()), send)
			}
		}
	}
	l, err := p.s.startProc(c, id, cfg, envs, userOf(req.Header()), m.GetTag(), execID, m.GetStdin(), processTimeout(req.Header()))
	if err != nil {
		return connErr(err)
	}
	defer l.detach()
	if err := send(startEvent(l.PID)); err != nil {
		return nil
	}
	tick := time.NewTicker(keepaliveOf(req.Header()))
	defer tick.Stop()
	for {
		select {
		case ch := <-l.out:
			if err := send(dataEvent(ch)); err != nil {
				return nil // the client went; the command runs on
			}
			tick.Reset(keepaliveOf(req.Header()))
		case <-l.done:
			return send(endEvent(l.res, l.err))
		case <-tick.C:
			if err := send(&pb.ProcessEvent{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}}); err != nil {
				return nil
			}
		case <-ctx.Done():
			return connErr(ctx.Err())
		}
	}
}

// startProc starts cfg in sandbox id as a new command with a pid of its
// own, and returns once the worker says it runs.
func (s *Server) startProc(c *sdk.Client, id string, cfg *pb.ProcessConfig, envs map[string]string, user, tag, execID string, stdin bool, timeout time.Duration) (*live, error) {
	var pid uint32
	err := s.records.addProc(id, func(r *record) {
		pid = max(r.NextPID, 1)
		r.NextPID = pid + 1
		if execID == "" { // unique though a lost record hands pid out again
			execID = fmt.Sprintf("e2b-%d-%s", pid, newID()[:8])
		}
		r.Procs = append(r.Procs, proc{PID: pid, Exec: execID, Tag: tag, Cmd: cfg.GetCmd(), Args: cfg.GetArgs(), Envs: envs, Cwd: cfg.GetCwd()})
	})
	if err != nil {
		return nil, err
	}
	l := &live{proc: proc{PID: pid, Exec: execID, Tag: tag, Cmd: cfg.GetCmd(), Args: cfg.GetArgs(), Envs: envs, Cwd: cfg.GetCwd()},
		sandbox: id, c: c, out: make(chan chunk), detached: make(chan struct{}), started: make(chan struct{}), done: make(chan struct{})}
	opts := sdk.ExecOptions{ID: execID, Args: append([]string{cfg.GetCmd()}, cfg.GetArgs()...), Cwd: homeRelative(cfg.GetCwd()), User: user,
		Stdout: writer{l, false}, Stderr: writer{l, true}, Started: func(string) { close(l.started) }}
	for _, k := range slices.Sorted(maps.Keys(envs)) {
		opts.Env = append(opts.Env, k+"="+envs[k])
	}
	var stdinR *io.PipeReader
	if stdin {
		stdinR, l.stdin = io.Pipe()
		opts.Stdin = stdinR
	}
	s.procs.add(l)
	go func() {
		defer s.procs.finish(l)
		var kill *time.Timer
		if timeout > 0 { // the command's lifetime, not the stream's
			kill = time.AfterFunc(timeout, func() { c.Sandbox(id).Signal(context.Background(), execID, syscall.SIGKILL) })
		}
		l.res, l.err = c.Sandbox(id).Exec(context.Background(), opts)
		if kill != nil {
			kill.Stop()
		}
		if stdinR != nil {
			stdinR.Close()
		}
		close(l.done)
	}()
	select {
	case <-l.started:
		return l, nil
	case <-l.done:
		select {
		case <-l.started:
			return l, nil
		default:
		}
		s.records.update(id, func(r *record) {
			r.Procs = slices.DeleteFunc(r.Procs, func(p proc) bool { return p.PID == pid })
		})
		if l.err == nil {
			l.err = fmt.Errorf("exec %s ended before it started: %w", execID, errdefs.ErrUnavailable)
		}
		return nil, l.err
	}
}

// homeRelative makes a relative directory relative to the home of the
// user commands run as (root's).
func homeRelative(dir string) string {
	switch {
	case dir == "":
		return ""
	case dir == "~":
		return "/root"
	case strings.HasPrefix(dir, "~/"):
		return "/root/" + dir[2:]
	case !strings.HasPrefix(dir, "/"):
		return "/root/" + dir
	}
	return dir
}

// replay streams a command's journaled output from its start and, once
// it ended, its exit: Connect, and a Start of a command seen before.
func (s *Server) replay(ctx context.Context, c *sdk.Client, id string, p proc, keepalive time.Duration, send func(*pb.ProcessEvent) error) error {
	if err := send(startEvent(p.PID)); err != nil {
		return nil
	}
	events := make(chan chunk)
	type ended struct {
		res api.ExecResult
		err error
	}
	end := make(chan ended, 1)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		w := func(stderr bool) io.Writer {
			return writerFunc(func(b []byte) (int, error) {
				select {
				case events <- chunk{stderr, slices.Clone(b)}:
					return len(b), nil
				case <-ctx.Done():
					return 0, ctx.Err()
				}
			})
		}
		res, err := c.Sandbox(id).Logs(ctx, p.Exec, true, w(false), w(true))
		end <- ended{res, err}
	}()
	tick := time.NewTicker(keepalive)
	defer tick.Stop()
	for {
		select {
		case ch := <-events:
			if err := send(dataEvent(ch)); err != nil {
				return nil
			}
		case e := <-end:
			if errdefs.IsNotFound(e.err) {
				return connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d: its output is gone from the sandbox's journal", p.PID))
			}
			return send(endEvent(e.res, e.err))
		case <-tick.C:
			if err := send(&pb.ProcessEvent{Event: &pb.ProcessEvent_Keepalive{Keepalive: &pb.ProcessEvent_KeepAlive{}}}); err != nil {
				return nil
			}
		case <-ctx.Done():
			return connErr(ctx.Err())
		}
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

func startEvent(pid uint32) *pb.ProcessEvent {
	return &pb.ProcessEvent{Event: &pb.ProcessEvent_Start{Start: &pb.ProcessEvent_StartEvent{Pid: pid}}}
}

func dataEvent(ch chunk) *pb.ProcessEvent {
	d := &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: ch.b}}
	if ch.stderr {
		d.Output = &pb.ProcessEvent_DataEvent_Stderr{Stderr: ch.b}
	}
	return &pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: d}}
}

// endEvent is how a command ended, as envd says it: its exit code and
// Go's status text; a failure of the sandbox or the worker under it is
// its error, never an exit code of its own.
func endEvent(res api.ExecResult, err error) *pb.ProcessEvent {
	e := &pb.ProcessEvent_EndEvent{ExitCode: int32(res.ExitCode), Exited: true, Status: "exit status " + strconv.Itoa(res.ExitCode)}
	switch {
	case err != nil:
		msg := err.Error()
		e.ExitCode, e.Exited, e.Status, e.Error = -1, false, "infrastructure failure", &msg
	case res.ExitCode > 128 && res.ExitCode <= 128+64:
		e.Status = "signal: " + strings.ToLower(syscall.Signal(res.ExitCode-128).String())
		if res.OOM {
			msg := "killed: out of memory (the sandbox's limit)"
			e.Error = &msg
		}
	}
	return &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: e}}
}

// find is the command a selector names in sandbox id.
func (s *Server) find(id string, sel *pb.ProcessSelector) (proc, error) {
	rec, _ := s.records.get(id)
	for i := len(rec.Procs) - 1; i >= 0; i-- {
		p := rec.Procs[i]
		switch v := sel.GetSelector().(type) {
		case *pb.ProcessSelector_Pid:
			if p.PID == v.Pid {
				return p, nil
			}
		case *pb.ProcessSelector_Tag:
			if p.Tag != "" && p.Tag == v.Tag {
				return p, nil
			}
		}
	}
	return proc{}, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %s not found in sandbox %s", selectorString(sel), id))
}

func selectorString(sel *pb.ProcessSelector) string {
	if t, ok := sel.GetSelector().(*pb.ProcessSelector_Tag); ok {
		return "tagged " + strconv.Quote(t.Tag)
	}
	return strconv.FormatUint(uint64(sel.GetPid()), 10)
}

func (p processService) Connect(ctx context.Context, req *connect.Request[pb.ConnectRequest], stream *connect.ServerStream[pb.ConnectResponse]) error {
	c, id, err := p.s.envdClient(ctx, req.Header())
	if err != nil {
		return connErr(err)
	}
	pr, err := p.s.find(id, req.Msg.GetProcess())
	if err != nil {
		return err
	}
	return p.s.replay(ctx, c, id, pr, keepaliveOf(req.Header()), func(ev *pb.ProcessEvent) error {
		return stream.Send(&pb.ConnectResponse{Event: ev})
	})
}

func (p processService) List(ctx context.Context, req *connect.Request[pb.ListRequest]) (*connect.Response[pb.ListResponse], error) {
	c, id, err := p.s.envdClient(ctx, req.Header())
	if err != nil {
		return nil, connErr(err)
	}
	rec, _ := p.s.records.get(id)
	running := p.s.procs.running(id)
	out := &pb.ListResponse{}
	for _, pr := range rec.Procs {
		l := running[pr.PID]
		if l == nil && p.s.procs.hasEnded(id, pr.PID) {
			continue
		}
		if l == nil {
			// Started by an earlier worker's front: the journal knows.
			if _, err := c.Sandbox(id).Logs(ctx, pr.Exec, false, nil, nil); !errors.Is(err, sdk.ErrRunning) {
				continue
			}
		} else {
			select {
			case <-l.done:
				continue
			default:
			}
		}
		info := &pb.ProcessInfo{Pid: pr.PID, Config: &pb.ProcessConfig{Cmd: pr.Cmd, Args: pr.Args, Envs: pr.Envs}}
		if pr.Cwd != "" {
			info.Config.Cwd = &pr.Cwd
		}
		if pr.Tag != "" {
			info.Tag = &pr.Tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func (p processService) SendSignal(ctx context.Context, req *connect.Request[pb.SendSignalRequest]) (*connect.Response[pb.SendSignalResponse], error) {
	c, id, err := p.s.envdClient(ctx, req.Header())
	if err != nil {
		return nil, connErr(err)
	}
	pr, err := p.s.find(id, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	sig := syscall.SIGKILL
	switch req.Msg.GetSignal() {
	case pb.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	case pb.Signal_SIGNAL_SIGKILL, pb.Signal_SIGNAL_UNSPECIFIED:
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unknown signal %d: give SIGKILL or SIGTERM", req.Msg.GetSignal()))
	}
	if err := c.Sandbox(id).Signal(ctx, pr.Exec, sig); err != nil {
		if errdefs.IsFailedPrecondition(err) || errdefs.IsNotFound(err) {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d has ended", pr.PID))
		}
		return nil, connErr(err)
	}
	return connect.NewResponse(&pb.SendSignalResponse{}), nil
}

// liveStdin is the stdin of a running command this front started.
func (s *Server) liveStdin(ctx context.Context, h http.Header, sel *pb.ProcessSelector) (*live, error) {
	_, id, err := s.envdClient(ctx, h)
	if err != nil {
		return nil, connErr(err)
	}
	pr, err := s.find(id, sel)
	if err != nil {
		return nil, err
	}
	l := s.procs.get(id, pr.PID)
	if l == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d is not running (or was started before the worker restarted, and its stdin went with it)", pr.PID))
	}
	if l.stdin == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d was started without stdin: start it with stdin: true", pr.PID))
	}
	return l, nil
}

func (p processService) SendInput(ctx context.Context, req *connect.Request[pb.SendInputRequest]) (*connect.Response[pb.SendInputResponse], error) {
	in := req.Msg.GetInput()
	if _, ok := in.GetInput().(*pb.ProcessInput_Pty); ok {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("terminals (pty) are not served by dsec's E2B front yet"))
	}
	l, err := p.s.liveStdin(ctx, req.Header(), req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	written := make(chan error, 1)
	go func() { _, err := l.stdin.Write(in.GetStdin()); written <- err }()
	select {
	case err := <-written:
		if err != nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d: its stdin is closed", l.PID))
		}
	case <-l.done:
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d has ended", l.PID))
	case <-ctx.Done():
		return nil, connErr(ctx.Err())
	}
	return connect.NewResponse(&pb.SendInputResponse{}), nil
}

func (p processService) CloseStdin(ctx context.Context, req *connect.Request[pb.CloseStdinRequest]) (*connect.Response[pb.CloseStdinResponse], error) {
	l, err := p.s.liveStdin(ctx, req.Header(), req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	l.stdin.Close()
	return connect.NewResponse(&pb.CloseStdinResponse{}), nil
}

func (p processService) Update(context.Context, *connect.Request[pb.UpdateRequest]) (*connect.Response[pb.UpdateResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("terminals (pty) are not served by dsec's E2B front yet"))
}

func (p processService) StreamInput(context.Context, *connect.ClientStream[pb.StreamInputRequest]) (*connect.Response[pb.StreamInputResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("streamed input is not served: use SendInput"))
}

// connErr is err as a Connect error of its class.
func connErr(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	case errdefs.IsNotFound(err):
		code = connect.CodeNotFound
	case errdefs.IsInvalidArgument(err):
		code = connect.CodeInvalidArgument
	case errdefs.IsAlreadyExists(err):
		code = connect.CodeAlreadyExists
	case errdefs.IsFailedPrecondition(err):
		code = connect.CodeFailedPrecondition
	case errdefs.IsUnauthorized(err):
		code = connect.CodeUnauthenticated
	case errdefs.IsPermissionDenied(err):
		code = connect.CodePermissionDenied
	case errdefs.IsResourceExhausted(err), errdefs.IsOutOfRange(err):
		code = connect.CodeResourceExhausted
	case errdefs.IsNotImplemented(err):
		code = connect.CodeUnimplemented
	case errdefs.IsUnavailable(err):
		code = connect.CodeUnavailable
	}
	return connect.NewError(code, err)
}
