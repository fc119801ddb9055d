package policy

import (
	"bytes"
	"errors"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"sigs.k8s.io/yaml"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/egress"
)

const issueExample = `apiVersion: dsec/v1
kind: Policy
network:
  egress:
    - to: 127.0.0.1/32
      ports: [18081]
      protocol: tcp
`

func TestParseExample(t *testing.T) {
	p, err := Parse([]byte(issueExample))
	if err != nil {
		t.Fatal(err)
	}
	r := p.Network.Egress
	if len(r) != 1 || r[0].To != "127.0.0.1/32" || r[0].Protocol != "tcp" || r[0].Ports[0] != (api.PortRange{Low: 18081, High: 18081}) {
		t.Fatalf("parsed %+v", r)
	}
	if p.Files != nil || p.Syscalls != nil {
		t.Fatal("sections left out must stay nil (the default's apply)")
	}
	e := Effective(p)
	if e.Syscalls == nil || e.Files == nil || len(e.Network.Egress) != 1 {
		t.Fatalf("effective %+v", e)
	}
	full, err := Parse([]byte(`{"apiVersion":"dsec/v1","kind":"Policy","metadata":{"name":"ci-strict"},
		"files":{"readOnly":["/opt/harness"],"hidden":["/answers"]},"syscalls":{"deny":["chroot"]},
		"network":{"mode":"nat","egress":[{"to":"10.0.0.0/8","ports":[80,"8000-8100"]},{"to":"*.Pypi.org.","protocol":"tcp"}]},
		"resources":{"pids":100,"memory":"512M","cpu":0.5}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := full.Network.Egress[0].Ports[1]; got != (api.PortRange{Low: 8000, High: 8100}) {
		t.Fatalf("range %+v", got)
	}
}

func TestParseBad(t *testing.T) {
	for _, c := range []struct{ doc, want string }{
		{"apiVersion: dsec/v2\nkind: Policy\n", "apiVersion"},
		{"apiVersion: dsec/v1\nkind: Pod\n", "kind"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egres: []\n", "unknown field"},
		{"apiVersion: dsec/v1\nkind: Policy\nkind: Policy\n", "already set"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: 10.0.0.0/33\n", "network.egress[0].to"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: 10.0.0.1/8\n", "network.egress[0].to"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: ::1\n    protocol: icmp\n", "protocol"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: ::1\n    ports: [0]\n", "bad port"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: ::1\n    ports: [\"9-3\"]\n", "bad port"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: ::1\n    ports: [70000]\n", "bad port"},
		{"apiVersion: dsec/v1\nkind: Policy\nfiles:\n  hidden: [answers]\n", "files.hidden[0]"},
		{"apiVersion: dsec/v1\nkind: Policy\nfiles:\n  hidden: [/tmp, /proc/self]\n", "/proc/self cannot be hidden"},
		{"apiVersion: dsec/v1\nkind: Policy\nfiles:\n  readOnly: [/a/../b]\n", "files.readOnly[0]"},
		{"apiVersion: dsec/v1\nkind: Policy\nfiles:\n  readWrite: [/tmp, tmp]\n", "files.readWrite[1]"},
		{"apiVersion: dsec/v1\nkind: Policy\nsyscalls:\n  deny: [nosuchcall]\n", "no system call"},
		{"apiVersion: dsec/v1\nkind: Policy\nsyscalls:\n  deny: [futex]\n", "init needs"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n  - to: \"*.com\"\n", "top-level domain"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n  - to: \"**\"\n", "every name"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  mode: nat\n  egress:\n  - to: \"a.*.org\"\n", "nowhere else"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: pypi.org\n", "needs a way out"},
		{"apiVersion: dsec/v1\nkind: Policy\nresources:\n  memory: lots\n", "resources.memory"},
		{"apiVersion: dsec/v1\nkind: Policy\nresources:\n  disk: lots\n", "resources.disk"},
		{"apiVersion: dsec/v1\nkind: Policy\nresources:\n  disk: 1M\n", "give at least 16 MiB"},
		{"apiVersion: dsec/v1\nkind: Policy\nmetadata:\n  name: ../x\n", "metadata.name"},
		{"[", "policy"},
		// Decoding errors speak the document's terms, not Go's or JSON's.
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress: 5\n", "network.egress: want a list, not a number"},
		{"apiVersion: dsec/v1\nkind: Policy\nnetwork: 5\n", "network: want a mapping, not a number"},
		{"apiVersion: dsec/v1\nkind: Policy\nfiles:\n  hidden: {a: 1}\n", "files.hidden: want a list, not a mapping"},
		{"[1]", "the document: want a mapping, not a list"},
	} {
		_, err := Parse([]byte(c.doc))
		if err != nil && (strings.Contains(err.Error(), "JSON") || strings.Contains(err.Error(), "Go ")) {
			t.Errorf("%q: %v speaks of JSON or Go", c.doc, err)
		}
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: %v (want a one-line invalid-argument error naming %q)", c.doc, err, c.want)
		}
	}
}

func TestAllowlist(t *testing.T) {
	es, err := Allowlist([]api.EgressRule{
		{To: "10.0.0.0/8", Ports: []api.PortRange{{Low: 80, High: 80}}, Protocol: "tcp"},
		{To: "10.1.0.0/16", Ports: []api.PortRange{{Low: 443, High: 443}}},
		{To: "2001:db8::/32", Protocol: "udp"},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ip := netip.MustParseAddr
	for _, c := range []struct {
		addr  string
		port  uint16
		proto uint8
		want  bool
	}{
		{"10.1.2.3", 80, ProtoTCP, true}, // the /8's rule holds inside the /16
		{"10.1.2.3", 443, ProtoUDP, true},
		{"10.2.0.1", 443, ProtoTCP, false},
		{"10.2.0.1", 80, ProtoUDP, false},
		{"::ffff:10.2.0.1", 80, ProtoTCP, true}, // IPv4-mapped meets the IPv4 rule
		{"11.0.0.1", 80, ProtoTCP, false},
		{"2001:db8::1", 53, ProtoUDP, true},
		{"2001:db8::1", 53, ProtoTCP, false},
	} {
		if got := Allows(es, ip(c.addr), c.port, c.proto); got != c.want {
			t.Errorf("%s:%d/%d: %v, want %v", c.addr, c.port, c.proto, got, c.want)
		}
	}
	var many []api.EgressRule
	for i := range MaxPortRules + 1 {
		many = append(many, api.EgressRule{To: "10.0.0.0/8", Ports: []api.PortRange{{Low: uint16(i + 1), High: uint16(i + 1)}}})
	}
	if _, err := Allowlist(many, nil); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("too many port rules: %v", err)
	}
	if e, err := Allowlist([]api.EgressRule{{To: "no-such-host.invalid"}, {To: "*.pypi.org"}}, nil); err != nil || len(e) != 0 {
		t.Fatalf("domain rules compile to no entries: %+v %v", e, err)
	}
}

// TestDomains: domain rules, the addresses they learn (never DoT or
// QUIC), and the addresses an answer may not open.
func TestDomains(t *testing.T) {
	rules := []api.EgressRule{
		{To: "192.168.7.0/24"}, {To: "0.0.0.0/0", Ports: []api.PortRange{{Low: 22, High: 22}}},
		{To: "Pypi.org."}, {To: "**.github.com", Ports: []api.PortRange{{Low: 400, High: 1000}}},
		{To: "dns.test", Protocol: "udp"},
	}
	d := Domains(rules)
	if len(d) != 3 || d[0].Index != 2 || d[0].Pattern.String() != "pypi.org" || d[1].Pattern.String() != "**.github.com" || d[2].Index != 4 {
		t.Fatalf("Domains: %+v", d)
	}
	a, b := netip.MustParseAddr("203.0.113.5"), netip.MustParseAddr("2001:db8::5")
	learned := Learned(rules, []egress.Learned{{Addr: a, Rule: 2}, {Addr: b, Rule: 3}, {Addr: a, Rule: 4}, {Addr: a, Rule: 99}})
	entries, err := Allowlist(append(slices.Clip(rules), learned...), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		addr  netip.Addr
		port  uint16
		proto uint8
		want  bool
	}{
		{a, 443, ProtoTCP, true}, {a, 80, ProtoTCP, true}, {a, 853, ProtoTCP, false}, {a, 443, ProtoUDP, false},
		{a, 853, ProtoUDP, false}, {a, 53, ProtoUDP, true}, {a, 22, ProtoTCP, true},
		{b, 443, ProtoTCP, true}, {b, 853, ProtoTCP, false}, {b, 1001, ProtoTCP, false}, {b, 443, ProtoUDP, false}, {b, 500, ProtoUDP, true},
		{netip.MustParseAddr("203.0.113.6"), 443, ProtoTCP, false},
	} {
		if got := Allows(entries, c.addr, c.port, c.proto); got != c.want {
			t.Errorf("%s port %d proto %d: allowed %v, want %v", c.addr, c.port, c.proto, got, c.want)
		}
	}
	static, err := Allowlist(rules, []netip.Addr{netip.MustParseAddr("198.51.100.1")})
	if err != nil {
		t.Fatal(err)
	}
	closed := Closed(static, []netip.Addr{netip.MustParseAddr("198.51.100.1")})
	for s, want := range map[string]bool{
		"127.0.0.1": true, "::1": true, "0.0.0.0": true, "::ffff:127.0.0.1": true, "169.254.169.254": true,
		"10.200.0.6": true, "198.51.100.1": true, "10.1.2.3": true, "172.16.0.1": true, "fd00::1": true, "fe80::1": true,
		"192.168.7.9": false, "192.168.8.9": true, "203.0.113.5": false, "2001:db8::1": false,
	} {
		if got := closed(netip.MustParseAddr(s)); got != want {
			t.Errorf("closed(%s) = %v, want %v", s, got, want)
		}
	}
}

func TestTightens(t *testing.T) {
	cur := Effective(&api.Policy{Files: &api.FilePolicy{Hidden: []string{"/answers"}}, Syscalls: &api.SyscallPolicy{Deny: []string{"chroot"}}})
	if err := Tightens(cur, Effective(&api.Policy{Files: &api.FilePolicy{Hidden: []string{"/answers", "/more"}},
		Syscalls: &api.SyscallPolicy{Deny: []string{"chroot", "mknod"}}})); err != nil {
		t.Fatal(err)
	}
	err := Tightens(cur, Effective(nil))
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "files.hidden /answers") || !strings.Contains(err.Error(), "syscalls.deny chroot") {
		t.Fatalf("loosening: %v", err)
	}
	rw := func(paths ...string) *api.Policy {
		return Effective(&api.Policy{Files: &api.FilePolicy{ReadWrite: paths}})
	}
	for _, c := range []struct {
		cur, next *api.Policy
		lost      string // "": tightens
	}{
		{Effective(nil), rw("/tmp"), ""},
		{rw("/tmp", "/work"), rw("/tmp/a", "/work"), ""},
		{rw("/tmp"), Effective(nil), "files.readWrite,"},
		{rw("/tmp"), rw("/tmp", "/etc"), "files.readWrite /etc"},
		{rw("/tmp"), rw("/tmpx"), "files.readWrite /tmpx"},
		{rw("/"), rw("/etc"), ""},
	} {
		err := Tightens(c.cur, c.next)
		if c.lost == "" && err != nil || c.lost != "" && (err == nil || !strings.Contains(err.Error()+",", c.lost)) {
			t.Errorf("%v -> %v: %v, want %q", c.cur.Files.ReadWrite, c.next.Files.ReadWrite, err, c.lost)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(issueExample))
	f.Add([]byte(`{"apiVersion":"dsec/v1","kind":"Policy","network":{"egress":[{"to":"::ffff:1.2.3.4/128","ports":["1-2"]}]}}`))
	f.Add([]byte("apiVersion: dsec/v1\nkind: Policy\nfiles:\n  hidden: [/a]\nsyscalls:\n  deny: [ptrace]\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := Parse(b)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("a multi-line error: %q", err)
			}
			return
		}
		if err := Validate(p); err != nil {
			t.Fatalf("parsed, then invalid: %v", err)
		}
		// What parses compiles (host names aside: no lookups here).
		var literal []api.EgressRule
		if p.Network != nil {
			for _, r := range p.Network.Egress {
				if _, err := parseTo(r.To); err == nil {
					literal = append(literal, r)
				}
			}
		}
		if _, err := Allowlist(literal, nil); err != nil && !errdefs.IsInvalidArgument(err) {
			t.Fatalf("allowlist: %v", err)
		}
	})
}

// TestSchema checks docs/policy.schema.json (make docs writes it) against
// the parser: documents the parser takes, the schema takes, and
// structural mistakes both refuse.
func TestSchema(t *testing.T) {
	f, err := os.Open("../../docs/policy.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	doc, err := jsonschema.UnmarshalJSON(f)
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("policy.schema.json", doc); err != nil {
		t.Fatal(err)
	}
	sch, err := c.Compile("policy.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	check := func(y string) error {
		j, err := yaml.YAMLToJSON([]byte(y))
		if err != nil {
			t.Fatal(err)
		}
		v, err := jsonschema.UnmarshalJSON(bytes.NewReader(j))
		if err != nil {
			t.Fatal(err)
		}
		return sch.Validate(v)
	}
	for _, good := range []string{issueExample, "apiVersion: dsec/v1\nkind: Policy\nfiles:\n  readWrite: [/tmp]\n  toolkitWritable: true\n" +
		"network:\n  egress:\n  - to: 10.0.0.0/8\n    ports: [80, \"8000-8100\"]\nresources:\n  pids: 10\n  memory: 1G\n  cpu: 0.5\n  disk: 10G\n"} {
		if _, err := Parse([]byte(good)); err != nil {
			t.Fatal(err)
		}
		if err := check(good); err != nil {
			t.Errorf("the schema refuses what the parser takes: %v\n%s", err, good)
		}
	}
	for _, bad := range []string{
		"apiVersion: dsec/v2\nkind: Policy\n",
		"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egres: []\n",
		"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: ::1\n    protocol: icmp\n",
		"apiVersion: dsec/v1\nkind: Policy\nnetwork:\n  egress:\n  - to: ::1\n    ports: [0]\n",
		"apiVersion: dsec/v1\nkind: Policy\nfiles:\n  readWrite: /tmp\n",
		"kind: Policy\n",
	} {
		if _, err := Parse([]byte(bad)); err == nil {
			t.Fatalf("the parser takes %q", bad)
		}
		if err := check(bad); err == nil {
			t.Errorf("the schema takes what the parser refuses:\n%s", bad)
		}
	}
}

// TestDenySet: a rule allowing every address opens neither the deny set
// nor the private ranges nor the host's addresses; naming a private
// range (or a part of it) opens it; a rule inside the deny set, or equal
// to a host address, is refused.
func TestDenySet(t *testing.T) {
	ip := netip.MustParseAddr
	host := []netip.Addr{ip("192.0.2.2"), ip("2001:db8::2")}
	es, err := Allowlist([]api.EgressRule{{To: "0.0.0.0/0"}, {To: "::/0"}, {To: "10.1.0.0/16"}}, host)
	if err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]bool{
		"8.8.8.8": true, "2606:4700::1": true, "10.1.2.3": true, "127.0.0.1": true,
		"169.254.169.254": false, "::ffff:169.254.169.254": false, "fe80::1": false, "10.200.0.1": false, "10.200.3.6": false,
		"10.2.0.1": false, "172.16.0.1": false, "192.168.1.1": false, "100.64.0.1": false, "fd00::1": false,
		"192.0.2.2": false, "192.0.2.3": true, "2001:db8::2": false, "224.0.0.1": false, "255.255.255.255": false,
	} {
		if got := Allows(es, ip(addr), 443, ProtoTCP); got != want {
			t.Errorf("%s: allowed %v, want %v", addr, got, want)
		}
	}
	// Only what a rule contains gets an entry: the default has none.
	if es, _ := Allowlist(Default().Network.Egress, host); len(es) != 2 {
		t.Errorf("the default policy has %d entries: %v", len(es), es)
	}
	for _, to := range []string{"169.254.169.254", "10.200.0.0/16", "10.200.4.0/30", "fe80::/10", "::ffff:10.200.0.1", "224.0.0.0/8"} {
		if _, err := Allowlist([]api.EgressRule{{To: to}}, nil); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), "no rule opens") {
			t.Errorf("%s: %v", to, err)
		}
		if err := Validate(&api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy", Network: &api.NetworkPolicy{Egress: []api.EgressRule{{To: to}}}}); err == nil {
			t.Errorf("validate %s: accepted", to)
		}
	}
	if _, err := Allowlist([]api.EgressRule{{To: "192.0.2.2"}}, host); !errdefs.IsInvalidArgument(err) {
		t.Errorf("a rule to the host's own address: %v", err)
	}
}
