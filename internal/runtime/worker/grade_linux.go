package worker

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/grade"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/policy"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/units"
)

// A grade runs the grader in a sandbox of its own (forGrade), made of
// the graded sandbox's pristine layers, what the carry rules take of
// its changes and the grader's layers: nothing else the agent did
// reaches it.

const (
	forGrade purpose = "(grade)"

	defaultGradeTimeout = 600 * time.Second
	maxGradeTimeout     = 24 * time.Hour
	defaultMaxCarried   = 64 << 20 // a carried file's bound
	maxGradeOutput      = 1 << 20  // of each stream, and of the result
)

var gradeIDRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z0-9_.:@-]{1,128}$`) })

// gradeLocks orders the grades of one id of one sandbox: a retry waits
// for the grade it repeats and answers what that answered. A key's lock
// lives while some grade holds or waits for it.
var gradeLocks = struct {
	sync.Mutex
	m map[string]*keyLock
}{m: map[string]*keyLock{}}

type keyLock struct {
	sync.Mutex
	users int
}

// lockGrade takes key's lock and returns its release.
func lockGrade(key string) (unlock func()) {
	gradeLocks.Lock()
	l := gradeLocks.m[key]
	if l == nil {
		l = &keyLock{}
		gradeLocks.m[key] = l
	}
	l.users++
	gradeLocks.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		gradeLocks.Lock()
		if l.users--; l.users == 0 {
			delete(gradeLocks.m, key)
		}
		gradeLocks.Unlock()
	}
}

func (w *worker) grade(r *http.Request, req api.GradeRequest) (api.Grade, error) {
	e, err := w.get(r)
	if err != nil {
		return api.Grade{}, err
	}
	if err := checkGrade(&req); err != nil {
		return api.Grade{}, err
	}
	sb := e.sb
	st := sb.Current()
	defer lockGrade(st.ID + "/" + req.ID)()
	file := filepath.Join(sb.Dir(), "grades", req.ID+".json")
	if b, err := os.ReadFile(file); err == nil {
		var done gradeDone
		if err := json.Unmarshal(b, &done); err == nil {
			if !sameJSON(done.Request, req) {
				return api.Grade{}, fmt.Errorf("grade id %s graded sandbox %s with another request already (%q): a retry must ask for the same grade; give another --id for another: %w",
					req.ID, st.Name, strings.Join(done.Request.Args, " "), errdefs.ErrAlreadyExists)
			}
			return done.Grade, nil
		}
	}
	g, err := w.gradeOnce(r.Context(), e, st, req)
	if err != nil {
		return api.Grade{}, err
	}
	b, _ := json.Marshal(gradeDone{Request: req, Grade: g})
	if err := os.MkdirAll(filepath.Dir(file), 0o700); err == nil {
		tmp := file + ".tmp"
		if os.WriteFile(tmp, b, 0o600) == nil {
			os.Rename(tmp, file)
		}
	}
	return g, nil
}

// gradeDone is a grade's record: what it was asked and answered.
type gradeDone struct {
	Request api.GradeRequest `json:"request"`
	Grade   api.Grade        `json:"grade"`
}

func sameJSON(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

// checkGrade refuses a request that cannot run, and fills its defaults.
func checkGrade(req *api.GradeRequest) error {
	if req.ID == "" {
		req.ID = runtime.RandomName("grade-")
	}
	if !gradeIDRE().MatchString(req.ID) {
		return fmt.Errorf("bad grade id %q: use up to 128 letters, digits and '_.:@-': %w", req.ID, errdefs.ErrInvalidArgument)
	}
	if len(req.Args) == 0 {
		return fmt.Errorf("a grade needs the grader's command (dsec grade SANDBOX --grader LAYER -- CMD...): %w", errdefs.ErrInvalidArgument)
	}
	if len(req.Grader) == 0 {
		return fmt.Errorf("a grade needs the grader's layer (--grader REF): what the agent could not touch: %w", errdefs.ErrInvalidArgument)
	}
	if req.Timeout < 0 || time.Duration(req.Timeout)*time.Second > maxGradeTimeout {
		return fmt.Errorf("grade timeout %ds: give 0 (the default, %s) to %d: %w", req.Timeout, defaultGradeTimeout, int(maxGradeTimeout.Seconds()), errdefs.ErrInvalidArgument)
	}
	if req.Result == "" {
		req.Result = api.DefaultGradeResult
	}
	if !path.IsAbs(req.Result) || path.Clean(req.Result) != req.Result {
		return fmt.Errorf("bad result path %q: give a clean absolute path in the grader's sandbox: %w", req.Result, errdefs.ErrInvalidArgument)
	}
	return nil
}

// gradeOnce grades e's sandbox (st as it was asked for).
func (w *worker) gradeOnce(ctx context.Context, e *entry, st runtime.State, req api.GradeRequest) (api.Grade, error) {
	ctx = context.WithoutCancel(ctx)
	pol := policy.Effective(st.Policy)
	carry, never, maxFile := req.Carry, []string(nil), int64(defaultMaxCarried)
	if g := pol.Grading; g != nil {
		if len(carry) == 0 {
			carry = g.Carry
		}
		never = g.Never
		if g.MaxFileBytes != "" {
			if n, err := units.ParseBytes(g.MaxFileBytes); err == nil && n > 0 {
				maxFile = n
			}
		}
	}
	if never == nil {
		never = grade.DefaultNever
	}
	// The result file is the grader's to write: one the agent left there
	// would answer for a grader that writes only on success.
	never = append(slices.Clone(never), globEscape(req.Result))
	rules, err := grade.Parse(carry, never)
	if err != nil {
		return api.Grade{}, err
	}
	// The grader's layers, as the caller may name them.
	gspec := api.SandboxSpec{Layers: req.Grader}
	if err := w.scopeOf(ctx).resolveSpec(ctx, &gspec); err != nil {
		return api.Grade{}, fmt.Errorf("the grader's layers: %w", err)
	}
	of, id := sha256.Sum256([]byte(st.ID)), sha256.Sum256([]byte(req.ID))
	ref, err := layer.ParseRef("dsec-grade/" + hex.EncodeToString(of[:8]) + ":" + hex.EncodeToString(id[:8]))
	if err != nil {
		return api.Grade{}, err
	}
	layer.Remove(ctx, w.host.Store, ref.String()) // an earlier try's, cut short
	e.op.Lock()
	c, err := e.sb.Carry(ctx, runtime.CarryOptions{Ref: ref, Rules: rules, MaxFileBytes: maxFile, Limits: w.cfg.SnapLimits})
	e.op.Unlock()
	if err != nil {
		return api.Grade{}, err
	}
	defer layer.Remove(ctx, w.host.Store, ref.String())
	g := api.Grade{Version: api.GradeVersion, ID: req.ID, Sandbox: st.Name, CarryRules: carry,
		Carried:       api.CarriedFiles{Digest: c.Layer.Digest.String(), Paths: c.Paths, Bytes: c.Bytes},
		FrozenSeconds: c.Frozen.Seconds()}

	// The grader's sandbox: the grader's layers over what was carried
	// over the pristine layers, the default policy (no network, no
	// hidden path of the agent's), the agent's resources.
	w.mu.Lock()
	asked := e.spec
	w.mu.Unlock()
	spec := api.SandboxSpec{Name: runtime.RandomName("grade-"), Backend: st.Backend, Layers: slices.Clone(gspec.Layers),
		CPU: asked.CPU, Memory: asked.Memory, Pids: asked.Pids, Disk: asked.Disk, Env: st.Env, Workdir: st.Workdir, User: st.User, UserNS: st.UserNS}
	spec.Layers = append(spec.Layers, c.Layer.Digest.String())
	for _, lo := range c.Pristine {
		spec.Layers = append(spec.Layers, lo.Digest.String())
	}
	t1 := time.Now()
	gsb, err := w.makeSandbox(withTrusted(ctx), spec, forGrade)
	if err != nil {
		return api.Grade{}, fmt.Errorf("grade %s: the grader's sandbox: %w", st.Name, err)
	}
	defer w.discard(spec.Name)
	g.StartSeconds = time.Since(t1).Seconds()
	t2 := time.Now()
	env := append(slices.Clone(req.Env), "DSEC_GRADE_RESULT="+req.Result)
	ex, _, err := gsb.Run(ctx, runtime.ExecSpec{ID: "grade", Args: req.Args, Env: env, Cwd: req.Cwd, User: req.User, MaxOutput: 2 * maxGradeOutput})
	if err != nil {
		return api.Grade{}, fmt.Errorf("grade %s: the grader's command: %w", st.Name, err)
	}
	timeout := cmp.Or(time.Duration(req.Timeout)*time.Second, defaultGradeTimeout)
	tctx, cancel := context.WithTimeout(ctx, timeout)
	res, err := ex.Result(tctx)
	cancel()
	if err != nil && tctx.Err() != nil {
		g.TimedOut = true
		gsb.Signal(ctx, "grade", syscall.SIGKILL)
		res, err = ex.Result(ctx)
	}
	if err != nil {
		return api.Grade{}, fmt.Errorf("grade %s: the grader's command: %w", st.Name, err)
	}
	if res.Err != "" {
		return api.Grade{}, fmt.Errorf("grade %s: the grader's command: %s: %w", st.Name, res.Err, runtime.ErrInfra)
	}
	g.GraderSeconds = time.Since(t2).Seconds()
	g.ExitCode = res.ExitCode
	g.Stdout, g.Stderr = readCapped(ex.StdoutPath()), readCapped(ex.StderrPath())
	g.Result, g.ResultError = gradeResult(gsb, req.Result)
	where := grade.Where{Rules: rules, Path: grade.PathOf(st.Env), Guarded: append(slices.Clone(pol.Files.Hidden), pol.Files.ReadOnly...), Result: req.Result}
	if tk := gsb.Current().Toolkit; len(tk) > 0 {
		where.Toolkit = func(p string) bool {
			return slices.ContainsFunc(tk, func(d string) bool { return policy.Under(p, d) })
		}
	}
	g.Tamper = tamperReport(c, where)
	return g, nil
}

// globEscape is p as a glob pattern that matches p alone.
func globEscape(p string) string {
	var b strings.Builder
	for _, r := range p {
		if strings.ContainsRune(`*?[\`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// tamperReport groups what the grade left out.
func tamperReport(c *runtime.Carried, where grade.Where) api.TamperReport {
	t := api.TamperReport{Processes: c.Processes, Groups: map[string]int{}, Paths: []api.TamperPath{}, Truncated: c.More}
	for _, ch := range c.Changes {
		p := api.TamperPath{Path: ch.Path, Group: ch.Group, Change: ch.Change, Type: ch.Type, Size: ch.Size, Digest: ch.Digest, Target: ch.Target, Why: ch.Why}
		if p.Group == "" || p.Group == api.TamperOther {
			p.Group = where.Group(ch.Path)
		}
		t.Groups[p.Group]++
		t.Paths = append(t.Paths, p)
	}
	sort.SliceStable(t.Paths, func(i, j int) bool { return t.Paths[i].Path < t.Paths[j].Path })
	return t
}

// readCapped is the start of a journaled stream, up to the bound.
func readCapped(p string) string {
	f, err := os.Open(p)
	if err != nil {
		return ""
	}
	defer f.Close()
	b, _ := io.ReadAll(io.LimitReader(f, maxGradeOutput))
	return string(b)
}

// gradeResult is the JSON the grader wrote at p in its sandbox, or why
// none was taken ("" and "": it wrote none).
func gradeResult(sb *runtime.Sandbox, p string) (json.RawMessage, string) {
	f, err := openIn(sb, p, os.O_RDONLY|syscall.O_NONBLOCK, 0) // (a fifo there must not hold the grade)
	if errdefs.IsNotFound(err) {
		return nil, ""
	}
	if err != nil {
		return nil, err.Error()
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Sprintf("%s is not a regular file", p)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxGradeOutput+1))
	switch {
	case err != nil:
		return nil, fmt.Sprintf("read %s: %v", p, err)
	case len(b) > maxGradeOutput:
		return nil, fmt.Sprintf("%s is larger than %d bytes", p, maxGradeOutput)
	case !json.Valid(b):
		return nil, fmt.Sprintf("%s is not JSON", p)
	}
	return json.RawMessage(b), ""
}
