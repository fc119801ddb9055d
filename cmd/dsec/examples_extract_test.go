package main

import (
	"bufio"
	"bytes"
	"reflect"
	"strings"
	"testing"
)

// Examples in the documentation: a fenced block whose info string is
// "sh example" or "python example" is run by the tests (TestExamples),
// page by page, as a new user would run it, so that a page never shows
// a command that does not work.

// example is one marked block of a page.
type example struct {
	Lang string // "sh" or "python"
	Line int    // the line of its opening fence
	Code string
}

// examples reads the marked blocks of a Markdown page in order. A block
// ends at a fence of at least its opening's length (CommonMark's rule);
// an unclosed one runs to the end of the page, as CommonMark reads it.
func examples(page []byte) []example {
	var out []example
	sc := bufio.NewScanner(bytes.NewReader(page))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var cur *example
	var fence string
	var body strings.Builder
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimLeft(line, " ")
		if fence != "" {
			if strings.HasPrefix(trimmed, fence) && strings.Trim(trimmed, string(fence[0])) == "" {
				if cur != nil {
					cur.Code = body.String()
					out = append(out, *cur)
				}
				cur, fence = nil, ""
				body.Reset()
				continue
			}
			if cur != nil {
				body.WriteString(line)
				body.WriteByte('\n')
			}
			continue
		}
		if len(line)-len(trimmed) > 3 { // indented code, not a fence
			continue
		}
		for _, f := range []string{"```", "~~~"} {
			if !strings.HasPrefix(trimmed, f) {
				continue
			}
			width := len(trimmed) - len(strings.TrimLeft(trimmed, f[:1]))
			fence = strings.Repeat(f[:1], width)
			info := strings.Fields(trimmed[width:])
			if len(info) == 2 && info[1] == "example" && (info[0] == "sh" || info[0] == "python") {
				cur = &example{Lang: info[0], Line: n}
			}
			break
		}
	}
	if cur != nil {
		cur.Code = body.String()
		out = append(out, *cur)
	}
	return out
}

// TestExamplesExtract: marked blocks are found in order with their lines;
// unmarked ones, other languages, longer fences and indented fences are
// read as CommonMark reads them.
func TestExamplesExtract(t *testing.T) {
	page := "# Title\n\n```sh example\ndsec ps\necho 'a ``` b'\n```\n\n```sh\nnot run\n```\n\n" +
		"````sh example\n```\nstill in\n````\n\n    ```sh example\n    indented: code, not a fence\n\n" +
		"~~~python example\nprint(1)\n~~~\n\n```js example\nno\n```\n\n```sh   example\nspaced\n```\n\n```sh example\nunclosed\n"
	got := examples([]byte(page))
	want := []example{
		{"sh", 3, "dsec ps\necho 'a ``` b'\n"},
		{"sh", 12, "```\nstill in\n"},
		{"python", 20, "print(1)\n"},
		{"sh", 28, "spaced\n"},
		{"sh", 32, "unclosed\n"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
}
