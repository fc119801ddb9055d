package policy

import (
	"cmp"
	"fmt"
	"net/netip"
	"path"
	"regexp"
	"slices"
	"strings"
	"sync"

	"github.com/containerd/errdefs"
	"sigs.k8s.io/yaml"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
	"github.com/dsec-project/dsec/internal/grade"
	"github.com/dsec-project/dsec/internal/units"
)

// MaxSize bounds a policy document.
const MaxSize = 1 << 20

// MaxEgress bounds a policy's egress rules.
const MaxEgress = 65536

// Parse reads a policy document (YAML or JSON) and validates it. Unknown
// and duplicate fields are errors.
func Parse(b []byte) (*api.Policy, error) {
	if len(b) > MaxSize {
		return nil, fmt.Errorf("policy is %d bytes, more than the %d a policy may be: %w", len(b), MaxSize, errdefs.ErrInvalidArgument)
	}
	var p api.Policy
	if err := yaml.UnmarshalStrict(b, &p); err != nil {
		return nil, fmt.Errorf("policy: %s: %w", decodeMessage(err), errdefs.ErrInvalidArgument)
	}
	if err := Validate(&p); err != nil {
		return nil, err
	}
	return &p, nil
}

var typeError = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`cannot unmarshal (\w+) into Go (?:struct field \w+\.([\w.]+)|value) of type (\S+)`)
})

// decodeMessage says what a document's decoding error means in the
// document's terms (a YAML or JSON document is decoded as JSON, whose
// errors name Go types).
func decodeMessage(err error) string {
	msg := err.Error()
	for _, p := range []string{"error converting YAML to JSON: ", "error unmarshaling JSON: ", "while decoding JSON: ", "json: "} {
		msg = strings.TrimPrefix(msg, p)
	}
	msg = strings.Join(strings.Fields(strings.ReplaceAll(msg, "unmarshal errors:\n", "")), " ")
	if m := typeError().FindStringSubmatch(msg); m != nil {
		field := m[2]
		if field == "" {
			field = "the document"
		}
		got := map[string]string{"object": "a mapping", "array": "a list", "bool": "true or false", "string": "a string"}[m[1]]
		if got == "" {
			got = "a " + m[1]
		}
		return fmt.Sprintf("%s: want %s, not %s", field, kindOf(m[3]), got)
	}
	if f, ok := strings.CutPrefix(msg, "unknown field "); ok {
		return "unknown field " + f + " (man dsec-policy lists the fields)"
	}
	return msg
}

// kindOf names a Go type as a document's kind of value.
func kindOf(goType string) string {
	switch {
	case strings.HasPrefix(goType, "[]"):
		return "a list"
	case strings.HasPrefix(goType, "map["), strings.HasPrefix(goType, "api."), strings.HasPrefix(goType, "*api."):
		return "a mapping"
	case goType == "string":
		return "a string"
	case goType == "bool":
		return "true or false"
	}
	return "a number"
}

// Validate checks a policy; the error names the field and what to do.
func Validate(p *api.Policy) error {
	bad := func(field, format string, a ...any) error {
		return fmt.Errorf("policy %s: %s: %w", field, fmt.Sprintf(format, a...), errdefs.ErrInvalidArgument)
	}
	if p.APIVersion != api.PolicyVersion {
		return bad("apiVersion", "%q: this dsec reads apiVersion: %s", p.APIVersion, api.PolicyVersion)
	}
	if p.Kind != "Policy" {
		return bad("kind", "%q: want kind: Policy", p.Kind)
	}
	if m := p.Metadata; m != nil && m.Name != "" && !validName(m.Name) {
		return bad("metadata.name", "%q: use letters, digits, '.', '_' and '-' (at most 128)", m.Name)
	}
	if f := p.Files; f != nil {
		for field, paths := range map[string][]string{"files.readOnly": f.ReadOnly, "files.hidden": f.Hidden, "files.readWrite": f.ReadWrite} {
			for i, q := range paths {
				if !path.IsAbs(q) || path.Clean(q) != q || strings.ContainsRune(q, 0) {
					return bad(fmt.Sprintf("%s[%d]", field, i), "%q: give an absolute, clean path inside the sandbox", q)
				}
				if q == "/" && field == "files.hidden" {
					return bad(fmt.Sprintf("%s[%d]", field, i), "the root cannot be hidden")
				}
				if (q == "/proc" || strings.HasPrefix(q, "/proc/")) && field == "files.hidden" {
					return bad(fmt.Sprintf("%s[%d]", field, i), "%s cannot be hidden: the sandbox's init starts every command in its working directory through /proc (what /proc must not show is masked already)", q)
				}
			}
		}
	}
	if s := p.Syscalls; s != nil {
		for i, name := range s.Deny {
			if err := checkDeny(name); err != nil {
				return bad(fmt.Sprintf("syscalls.deny[%d]", i), "%v", err)
			}
		}
	}
	if n := p.Network; n != nil {
		if n.Mode != "" && n.Mode != api.NetworkLoopback && n.Mode != api.NetworkNAT {
			return bad("network.mode", "%q: give loopback or nat", n.Mode)
		}
		if len(n.Egress) > MaxEgress {
			return bad("network.egress", "%d rules, more than %d", len(n.Egress), MaxEgress)
		}
		for i, r := range n.Egress {
			field := fmt.Sprintf("network.egress[%d]", i)
			pfx, err := parseTo(r.To)
			if err != nil {
				if _, perr := egress.ParsePattern(r.To); perr != nil {
					return bad(field+".to", "%q is not a CIDR, an address or a domain name (name, *.domain or **.domain): %v", r.To, perr)
				}
				if cmp.Or(n.Mode, api.NetworkLoopback) != api.NetworkNAT {
					return bad(field+".to", "%q is a domain rule, which needs a way out: give network.mode: nat", r.To)
				}
			}
			if d, ok := denied(pfx, nil); err == nil && ok {
				return bad(field+".to", "%s is in %s, which no rule opens (link-local and metadata addresses, the NAT pool of the host's gateways and other sandboxes, multicast): allow the addresses around it instead", r.To, d)
			}
			if r.Protocol != "" && r.Protocol != "tcp" && r.Protocol != "udp" {
				return bad(field+".protocol", "%q: give tcp or udp (or leave it out for both)", r.Protocol)
			}
			for j, pr := range r.Ports {
				if pr.Low == 0 || pr.High < pr.Low {
					return bad(fmt.Sprintf("%s.ports[%d]", field, j), "give a port 1-65535 or a range \"LOW-HIGH\"")
				}
			}
		}
	}
	if r := p.Resources; r != nil {
		if r.Pids < 0 || r.CPU < 0 {
			return bad("resources", "pids and cpu cannot be negative")
		}
		if r.Memory != "" {
			if _, err := units.ParseBytes(r.Memory); err != nil {
				return bad("resources.memory", "%q: give bytes, or a number with K, M, G or T", r.Memory)
			}
		}
		if r.Disk != "" {
			if d, err := units.ParseBytes(r.Disk); err != nil {
				return bad("resources.disk", "%q: give bytes, or a number with K, M, G or T", r.Disk)
			} else if d < api.MinDisk {
				return bad("resources.disk", "%s is too small: give at least %d MiB", r.Disk, api.MinDisk>>20)
			}
		}
	}
	if g := p.Grading; g != nil {
		if len(g.Carry) > 0 {
			if _, err := grade.Parse(g.Carry, g.Never); err != nil {
				return bad("grading", "%v", strings.TrimSuffix(err.Error(), ": invalid argument"))
			}
		}
		if g.MaxFileBytes != "" {
			if n, err := units.ParseBytes(g.MaxFileBytes); err != nil || n <= 0 {
				return bad("grading.maxFileBytes", "%q: give bytes, or a number with K, M, G or T", g.MaxFileBytes)
			}
		}
	}
	return nil
}

var nameRe = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`) })

func validName(s string) bool { return len(s) <= 128 && nameRe().MatchString(s) }

// ValidName says whether s may name a stored policy.
func ValidName(s string) bool { return validName(s) }

// parseTo reads a CIDR or an address as a prefix.
func parseTo(s string) (netip.Prefix, error) {
	if pfx, err := netip.ParsePrefix(s); err == nil {
		if pfx.Masked() != pfx {
			return netip.Prefix{}, fmt.Errorf("%s has host bits set (did you mean %s?)", s, pfx.Masked())
		}
		return pfx, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// Default is the secure default every sandbox runs under: the syscall
// allowlist, the toolkit layer read-only, and no network but the
// sandbox's own loopback.
func Default() *api.Policy {
	return &api.Policy{
		APIVersion: api.PolicyVersion, Kind: "Policy", Metadata: &api.PolicyMetadata{Name: "default"},
		Files:    &api.FilePolicy{},
		Syscalls: &api.SyscallPolicy{},
		Network: &api.NetworkPolicy{Egress: []api.EgressRule{
			{To: "127.0.0.0/8"}, {To: "::1/128"},
		}},
		Resources: &api.ResourcePolicy{},
	}
}

// Effective is p with every section it leaves out taken from the
// default. p may be nil.
func Effective(p *api.Policy) *api.Policy {
	d := Default()
	if p == nil {
		return d
	}
	out := *p
	if out.Files == nil {
		out.Files = d.Files
	}
	if out.Syscalls == nil {
		out.Syscalls = d.Syscalls
	}
	if out.Network == nil {
		out.Network = d.Network
	}
	if out.Resources == nil {
		out.Resources = d.Resources
	}
	if out.Metadata == nil {
		out.Metadata = &api.PolicyMetadata{}
	}
	return &out
}

// Tightens says whether next can replace cur on a running sandbox: its
// file and syscall sections may only add restrictions (Landlock and
// seccomp cannot be loosened for a process). The network may change
// either way. cur and next are effective policies.
func Tightens(cur, next *api.Policy) error {
	var lost []string
	for _, q := range cur.Files.ReadOnly {
		if !slices.Contains(next.Files.ReadOnly, q) && !slices.Contains(next.Files.Hidden, q) {
			lost = append(lost, "files.readOnly "+q)
		}
	}
	for _, q := range cur.Files.Hidden {
		if !slices.Contains(next.Files.Hidden, q) {
			lost = append(lost, "files.hidden "+q)
		}
	}
	if rw := cur.Files.ReadWrite; len(rw) > 0 {
		if len(next.Files.ReadWrite) == 0 {
			lost = append(lost, "files.readWrite")
		}
		for _, q := range next.Files.ReadWrite {
			if !slices.ContainsFunc(rw, func(d string) bool { return Under(q, d) }) {
				lost = append(lost, "files.readWrite "+q)
			}
		}
	}
	if !cur.Files.ToolkitWritable && next.Files.ToolkitWritable {
		lost = append(lost, "files.toolkitWritable")
	}
	for _, s := range cur.Syscalls.Deny {
		if !slices.Contains(next.Syscalls.Deny, s) {
			lost = append(lost, "syscalls.deny "+s)
		}
	}
	if len(lost) > 0 {
		return fmt.Errorf("the policy would loosen %s, which cannot be undone for a running sandbox: keep them, or restart it with dsec rm and dsec run --policy: %w",
			strings.Join(lost, ", "), errdefs.ErrFailedPrecondition)
	}
	return nil
}

// Under says whether the sandbox path p is dir or beneath it.
func Under(p, dir string) bool {
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}
