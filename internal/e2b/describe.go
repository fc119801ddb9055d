package e2b

import (
	"cmp"
	"fmt"
	"net/http"
	"net/url"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/sdk"
)

// What the SDKs see of a sandbox: its record (one made outside E2B gets
// one), its state, its place in a list, its detail and metrics.

// recordOf is the record of a sandbox the caller sees (one dsec made
// outside E2B gets one as its template its top layer).
func (s *Server) recordOf(sb api.Sandbox) record {
	if rec, ok := s.records.get(sb.Name); ok && (rec.Sandbox == sb.ID || rec.Sandbox == "") {
		return rec
	}
	if st := sb.E2B; st != nil { // its worker's front's (a gateway's front)
		return record{ID: sb.Name, Sandbox: sb.ID, Owner: sb.Owner, Template: st.Template, Metadata: st.Metadata, Started: st.Started,
			EndAt: st.EndAt, OnTimeout: st.OnTimeout}
	}
	tpl := sb.Snapshot
	if tpl == "" && len(sb.Layers) > 0 {
		tpl = sb.Layers[0]
	}
	return record{ID: sb.Name, Sandbox: sb.ID, Owner: sb.Owner, Template: tpl, Started: sb.Created}
}

// stateOf is a sandbox's E2B state: running, or paused (frozen with its
// memory, or stopped with its files).
func stateOf(sb api.Sandbox) string {
	switch sb.Status {
	case api.StatusPaused, api.StatusStopped, api.StatusDead:
		return "paused"
	}
	return "running"
}

// listedSandbox is ListedSandbox; sandboxDetail SandboxDetail.
type listedSandbox struct {
	TemplateID  string            `json:"templateID"`
	SandboxID   string            `json:"sandboxID"`
	ClientID    string            `json:"clientID"`
	StartedAt   time.Time         `json:"startedAt"`
	EndAt       time.Time         `json:"endAt"`
	CPUCount    int               `json:"cpuCount"`
	MemoryMB    int64             `json:"memoryMB"`
	DiskSizeMB  int64             `json:"diskSizeMB"`
	State       string            `json:"state"`
	EnvdVersion string            `json:"envdVersion"`
	Metadata    map[string]string `json:"metadata,omitempty"`
}

type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken string     `json:"envdAccessToken,omitempty"`
	Domain          *string    `json:"domain"`
	Lifecycle       *lifecycle `json:"lifecycle,omitempty"`
}

type lifecycle struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

func (s *Server) listed(sb api.Sandbox, rec record) listedSandbox {
	cpus := int(sb.CPU + 0.999)
	if cpus == 0 {
		cpus = runtime.NumCPU()
	}
	return listedSandbox{TemplateID: rec.Template, SandboxID: sb.Name, StartedAt: rec.Started, EndAt: rec.EndAt,
		CPUCount: cpus, MemoryMB: cmp.Or(sb.MemoryLimit, sb.Memory) >> 20, DiskSizeMB: cmp.Or(sb.DiskLimit, sb.Disk) >> 20,
		State: stateOf(sb), EnvdVersion: EnvdVersion, Metadata: rec.Metadata}
}

func (s *Server) list(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	q := r.URL.Query()
	want, err := metadataQuery(q.Get("metadata"))
	if err != nil {
		return err
	}
	states := map[string]bool{}
	for _, st := range strings.Split(q.Get("state"), ",") {
		switch st {
		case "":
		case "running", "paused":
			states[st] = true
		default:
			return fmt.Errorf("bad state %q: give running or paused: %w", st, errdefs.ErrInvalidArgument)
		}
	}
	limit := 100
	if l := q.Get("limit"); l != "" {
		if limit, err = strconv.Atoi(l); err != nil || limit < 1 || limit > 100 {
			return fmt.Errorf("bad limit %q: give 1 to 100: %w", l, errdefs.ErrInvalidArgument)
		}
	}
	var after time.Time
	if a := q.Get("startedAfter"); a != "" {
		if after, err = time.Parse(time.RFC3339, a); err != nil {
			return fmt.Errorf("bad startedAfter %q: give an RFC 3339 time: %w", a, errdefs.ErrInvalidArgument)
		}
	}
	sbs, err := c.List(r.Context())
	if err != nil {
		return err
	}
	var out []listedSandbox
	for _, sb := range sbs {
		rec := s.recordOf(sb)
		ls := s.listed(sb, rec)
		if len(states) > 0 && !states[ls.State] || !after.IsZero() && !rec.Started.After(after) ||
			q.Get("template") != "" && q.Get("template") != rec.Template || !matches(rec.Metadata, want) {
			continue
		}
		out = append(out, ls)
	}
	desc := q.Get("order") == "desc"
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if !a.StartedAt.Equal(b.StartedAt) {
			return a.StartedAt.Before(b.StartedAt) != desc
		}
		return a.SandboxID < b.SandboxID
	})
	// The token is the last id of the page before: stable while
	// sandboxes come and go.
	if tok := q.Get("nextToken"); tok != "" {
		i := slices.IndexFunc(out, func(l listedSandbox) bool { return l.SandboxID == tok })
		if i < 0 {
			return fmt.Errorf("bad nextToken %q: the sandbox it continues after is gone: list from the start: %w", tok, errdefs.ErrInvalidArgument)
		}
		out = out[i+1:]
	}
	if len(out) > limit {
		out = out[:limit]
		rw.Header().Set("X-Next-Token", out[limit-1].SandboxID)
	}
	if out == nil {
		out = []listedSandbox{}
	}
	writeJSON(rw, http.StatusOK, out)
	return nil
}

// metadataQuery reads the list's metadata filter: a query string whose
// keys and values the SDK also escaped.
func metadataQuery(v string) (map[string]string, error) {
	if v == "" {
		return nil, nil
	}
	q, err := url.ParseQuery(v)
	if err != nil {
		return nil, fmt.Errorf("bad metadata filter %q: give k=v&k2=v2: %w", v, errdefs.ErrInvalidArgument)
	}
	out := map[string]string{}
	for k, vs := range q {
		uk, err1 := url.QueryUnescape(k)
		uv, err2 := url.QueryUnescape(vs[0])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("bad metadata filter %q: %w", v, errdefs.ErrInvalidArgument)
		}
		out[uk] = uv
	}
	return out, nil
}

func matches(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

func (s *Server) info(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	sb, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	if err := s.ensureRecord(sb); err != nil {
		return err
	}
	rec := s.recordOf(sb)
	d := sandboxDetail{listedSandbox: s.listed(sb, rec), EnvdAccessToken: s.accessToken(rec),
		Lifecycle: &lifecycle{OnTimeout: cmp.Or(rec.OnTimeout, "kill"), AutoResume: rec.AutoResume}}
	if dom := s.domain(r.Context()); dom != "" {
		d.Domain = &dom
	}
	writeJSON(rw, http.StatusOK, d)
	return nil
}

func (s *Server) metrics(rw http.ResponseWriter, r *http.Request, c *sdk.Client, _ caller) error {
	sb, err := inspect(r.Context(), c, r.PathValue("id"))
	if err != nil {
		return err
	}
	ls := s.listed(sb, s.recordOf(sb))
	now := time.Now().UTC()
	writeJSON(rw, http.StatusOK, []map[string]any{{
		"timestamp": now, "timestampUnix": now.Unix(), "cpuCount": ls.CPUCount, "cpuUsedPct": 0.0,
		"memUsed": sb.MemoryBytes, "memTotal": sb.MemoryLimit, "memCache": 0, "diskUsed": sb.DiskUsed, "diskTotal": sb.DiskLimit,
	}})
	return nil
}
