package image

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

func TestParseReference(t *testing.T) {
	for _, c := range []struct{ in, want, host, store string }{
		{"python:3.12", "docker.io/library/python:3.12", "registry-1.docker.io", "docker.io/library/python:3.12"},
		{"docker://python", "docker.io/library/python:latest", "registry-1.docker.io", "docker.io/library/python:latest"},
		{"swebench/sweb.eval.x86_64.django_1776_django-11099:latest", "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest", "registry-1.docker.io", ""},
		{"index.docker.io/library/ubuntu:24.04", "docker.io/library/ubuntu:24.04", "registry-1.docker.io", ""},
		{"docker.io/ubuntu", "docker.io/library/ubuntu:latest", "registry-1.docker.io", ""},
		{"ghcr.io/org/env:v1", "ghcr.io/org/env:v1", "ghcr.io", "ghcr.io/org/env:v1"},
		{"oci://127.0.0.1:5000/repo/x:t", "127.0.0.1:5000/repo/x:t", "127.0.0.1:5000", "127.0.0.1_5000/repo/x:t"},
		{"localhost/x", "localhost/x:latest", "localhost", "localhost/x:latest"},
		{"127.0.0.1:5000/r@sha256:" + strings.Repeat("a", 64), "127.0.0.1:5000/r@sha256:" + strings.Repeat("a", 64), "127.0.0.1:5000",
			"127.0.0.1_5000/r:sha256-" + strings.Repeat("a", 64)},
	} {
		r, err := ParseReference(c.in)
		if err != nil {
			t.Errorf("%s: %v", c.in, err)
			continue
		}
		if r.String() != c.want || r.Host() != c.host {
			t.Errorf("%s: %s on %s, want %s on %s", c.in, r, r.Host(), c.want, c.host)
		}
		if tag, err := r.StoreTag(); c.store != "" && (err != nil || tag.String() != c.store) {
			t.Errorf("%s: store tag %s %v, want %s", c.in, tag, err, c.store)
		}
	}
	for _, in := range []string{"", "UPPER/case", "oci://noregistry", "http://x/y", "a b", "x:", "docker.io/library/python:3.12@sha256:zz", "[::1]:5000/x"} {
		if r, err := ParseReference(in); err == nil {
			t.Errorf("%q: parsed as %s, want an error", in, r)
		} else if strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: a multi-line error %q", in, err)
		}
	}
	for in, want := range map[string]bool{"127.0.0.1:5000/x": true, "localhost:5000/x": true, "ghcr.io/x": false, "10.0.0.1:5000/x": false} {
		if r, err := ParseReference(in); err != nil || r.Loopback() != want {
			t.Errorf("%s: loopback %v %v, want %v", in, r.Loopback(), err, want)
		}
	}
}

func TestParsePlatform(t *testing.T) {
	p, err := ParsePlatform("linux/arm64/v8")
	if err != nil || p != (Platform{"linux", "arm64", "v8"}) {
		t.Errorf("%+v %v", p, err)
	}
	if !p.matches(&ocispec.Platform{OS: "linux", Architecture: "arm64"}) {
		t.Error("arm64/v8 should match arm64 without a variant")
	}
	if (Platform{"linux", "arm", "v7"}).matches(&ocispec.Platform{OS: "linux", Architecture: "arm", Variant: "v6"}) {
		t.Error("arm/v7 matched arm/v6")
	}
	for _, bad := range []string{"linux", "/amd64", "linux/", "a/b/c/d"} {
		if _, err := ParsePlatform(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestParseManifest(t *testing.T) {
	d := func(mt string) ocispec.Descriptor {
		return ocispec.Descriptor{MediaType: mt, Digest: digest.FromString(mt), Size: 10}
	}
	good := ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, Config: d(ocispec.MediaTypeImageConfig),
		Layers: []ocispec.Descriptor{d(ocispec.MediaTypeImageLayerGzip), d(dockerLayer)}}
	b, _ := json.Marshal(good)
	if m, err := parseManifest(b); err != nil || len(m.layers) != 2 {
		t.Fatalf("%+v %v", m, err)
	}
	for name, mod := range map[string]func(*ocispec.Manifest){
		"artifact":   func(m *ocispec.Manifest) { m.Config = d("application/vnd.example+json") },
		"no layers":  func(m *ocispec.Manifest) { m.Layers = nil },
		"encrypted":  func(m *ocispec.Manifest) { m.Layers[0] = d("application/vnd.oci.image.layer.v1.tar+gzip+encrypted") },
		"schema 1":   func(m *ocispec.Manifest) { m.SchemaVersion = 1 },
		"bad digest": func(m *ocispec.Manifest) { m.Layers[1].Digest = "sha256:xyz" },
		"foreign": func(m *ocispec.Manifest) {
			m.Layers[0] = d(dockerForeign)
			m.Layers[0].URLs = []string{"https://example.com/l"}
		},
	} {
		m := good
		m.Layers = append([]ocispec.Descriptor(nil), good.Layers...)
		mod(&m)
		b, _ := json.Marshal(m)
		if _, err := parseManifest(b); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

func FuzzParseManifest(f *testing.F) {
	f.Add([]byte(`{"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:` + strings.Repeat("a", 64) + `","size":2},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:` + strings.Repeat("b", 64) + `","size":3}]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseManifest(b)
		if err != nil {
			return
		}
		if len(m.layers) == 0 || len(m.layers) > maxLayers || m.config.Digest.Validate() != nil {
			t.Fatalf("accepted %+v", m)
		}
		for _, l := range m.layers {
			if l.Digest.Validate() != nil || l.Size < 0 {
				t.Fatalf("accepted layer %+v", l)
			}
		}
	})
}

func FuzzParseIndex(f *testing.F) {
	f.Add([]byte(`{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:` + strings.Repeat("a", 64) + `","size":2,"platform":{"os":"linux","architecture":"amd64"}}]}`))
	f.Add([]byte(`{"manifests":[{"platform":null}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := parseIndex(b, Platform{OS: "linux", Architecture: "amd64"})
		if err != nil {
			return
		}
		if d.Digest.Validate() != nil || d.Platform == nil || d.Platform.Architecture != "amd64" {
			t.Fatalf("picked %+v", d)
		}
	})
}

func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:`+strings.Repeat("c", 64)+`"]},"config":{"Env":["A=1"]}}`), 1)
	f.Fuzz(func(t *testing.T, b []byte, n int) {
		_, ids, err := parseConfig(b, n, Platform{OS: "linux", Architecture: "amd64"})
		if err != nil {
			return
		}
		if len(ids) != n {
			t.Fatalf("%d diff IDs for %d layers", len(ids), n)
		}
		for _, d := range ids {
			if d.Validate() != nil {
				t.Fatalf("accepted diff ID %q", d)
			}
		}
	})
}

func FuzzParseReference(f *testing.F) {
	for _, s := range []string{"python:3.12", "oci://127.0.0.1:5000/a/b@sha256:" + strings.Repeat("a", 64), "docker://x/y:z"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseReference(s)
		if err != nil {
			return
		}
		tag, err := r.StoreTag()
		if err != nil {
			t.Fatalf("%q parsed, but has no store tag: %v", s, err)
		}
		again, err := ParseReference(r.String())
		if err != nil || again != r {
			t.Fatalf("%q -> %s -> %+v %v", s, r, again, err)
		}
		if tag.Name == "" || tag.Version == "" {
			t.Fatalf("%q: store tag %+v", s, tag)
		}
	})
}
