// Renders a Go text/template over {"Messages": [...]} as Ollama does: reads the template file and a JSON list
// of {"Role", "Content"} messages, prints the prompt.
package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func main() {
	text, err := os.ReadFile(os.Args[1])
	if err != nil {
		panic(err)
	}
	var messages []Message
	raw, err := os.ReadFile(os.Args[2])
	if err != nil {
		panic(err)
	}
	if err := json.Unmarshal(raw, &messages); err != nil {
		panic(err)
	}
	tmpl := template.Must(template.New("prompt").Parse(string(text)))
	if err := tmpl.Execute(os.Stdout, map[string]any{"Messages": messages}); err != nil {
		panic(err)
	}
}
